"""Registration through our package's `vllm.general_plugins` entry point: cheap,
idempotent, HISPARSE always, CPU_ATTN only when asked (HISPARSE_VLLM_CPU=1)."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

from bridge import plugin


def _run(code: str, **env) -> str:
    import os
    e = dict(os.environ)
    e.pop("HISPARSE_VLLM_CPU", None)
    e.update(env)
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_entry_point_is_installed():
    eps = [e for e in md.entry_points(group="vllm.general_plugins")
           if e.value == "bridge.plugin:register"]
    assert eps, "hisparse's vllm.general_plugins entry point is not installed"
    assert eps[0].load() is plugin.register


def test_loading_imports_nothing_heavy():
    out = _run("import sys, bridge.plugin as p; before = set(sys.modules); "
               "print(sorted(m for m in ('torch', 'jax', 'vllm', 'bridge.vllm_backend') "
               "if m in before))")
    assert out == "[]"
    out = _run("import sys, bridge.plugin as p; p.register(); p.register(); "
               "print(sorted(m for m in ('jax', 'bridge.vllm_backend', 'bridge.vllm_cpu', "
               "'hisparse_jax') if m in sys.modules))")
    assert out == "[]"  # class paths are strings: the backend loads when vLLM picks it


def test_registers_hisparse_and_cpu_only_when_asked():
    code = ("from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
            "import bridge.plugin as p; r1 = p.register(); r2 = p.register(); "
            "print(r1 == r2, E['HISPARSE'].get_path(), E.CPU_ATTN.get_path())")
    assert _run(code) == ("True bridge.vllm_backend.HiSparseBackend "
                          "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend")
    assert _run(code, HISPARSE_VLLM_CPU="1") == ("True bridge.vllm_backend.HiSparseBackend "
                                                 "bridge.vllm_cpu.HiSparseCPUBackend")


def test_vllm_loads_the_plugin_itself():
    """vLLM's own plugin loader (what every engine process runs) finds and calls it."""
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
            "print(E['HISPARSE'].get_class().get_name(), E.CPU_ATTN.get_class().__name__)")
    assert _run(code, HISPARSE_VLLM_CPU="1") == "HISPARSE HiSparseCPUBackend"


def test_cpu_flag_parsing():
    assert plugin.cpu_override_requested({"HISPARSE_VLLM_CPU": "1"})
    assert plugin.cpu_override_requested({"HISPARSE_VLLM_CPU": "true"})
    assert not plugin.cpu_override_requested({})
    assert not plugin.cpu_override_requested({"HISPARSE_VLLM_CPU": "0"})
    # every switch parses alike (HISPARSE_EXACT=true was ignored: only "1" counted)
    for on in ("1", "true", "Yes", " on "):
        assert plugin.env_flag("HISPARSE_EXACT", {"HISPARSE_EXACT": on})
    assert not plugin.env_flag("HISPARSE_EXACT", {"HISPARSE_EXACT": "no"})
