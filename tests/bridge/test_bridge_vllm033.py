"""Contract tests against vLLM 0.33's real Python classes (the GPU path, which no
machine here runs): test_bridge_backend.py again, in a process that imports vLLM
0.33 (`pip install --no-deps --target .venv-vllm/vllm033 vllm==0.33.0`, put first
on sys.path; bridge/setup_env.sh installs it). The HISPARSE enum member registers
through the entry point, the builder builds on 0.33's CommonAttentionMetadata,
forward on mixed batches equals a dense torch reference, and 0.33's
validate_configuration and supports_kv_cache_dtype answer correctly."""

from __future__ import annotations

import os
import subprocess
import sys

from bridge_helpers import ROOT, bridge_env

VLLM_033 = ROOT / ".venv-vllm" / "vllm033"


def test_backend_contract_on_vllm_033():
    site = os.environ.get("HISPARSE_VLLM033_PATH", str(VLLM_033))
    assert os.path.isdir(os.path.join(site, "vllm")), \
        f"vLLM 0.33 is not installed at {site} (run bridge/setup_env.sh)"
    env = bridge_env(PYTHONPATH=site + os.pathsep + str(ROOT))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "addopts=", str(ROOT / "tests/bridge/test_bridge_backend.py")],
                       check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]
