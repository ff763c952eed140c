"""The bridge's tests. Most need torch and vLLM (the bridge environment, Python 3.11,
jax 0.10.2: `make test-bridge`, bridge/setup_env.sh); test_bridge_runtime.py and
test_bridge_compat.py need neither and also run in the main suite (Python 3.12, jax
0.11.2).

Under an interpreter without torch and vLLM (the main .venv) the files that need them
are not collected: they run in the bridge environment, which `make test` builds
and runs. This is not a skip: in the bridge environment a missing or broken vLLM
fails these tests.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from bridge_helpers import HERE, ROOT

IN_BRIDGE_ENV = all(importlib.util.find_spec(m) is not None for m in ("torch", "vllm"))

collect_ignore = [] if IN_BRIDGE_ENV else [
    p.name for p in HERE.glob("test_bridge_*.py")
    if p.name not in ("test_bridge_runtime.py", "test_bridge_compat.py")]

@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct as a bf16 HF checkpoint, exported by our own loader
    (`hisparse export --model smollm2-135m --format hf DIR`: hisparse_jax.models).
    HISPARSE_SMOLLM2_HF=DIR reuses an export; otherwise it is made once per run
    in the main env's Python (the GGUF is fetched and verified by the registry)."""
    given = os.environ.get("HISPARSE_SMOLLM2_HF")
    if given:
        return given
    out = ROOT / ".pytest_cache" / "smollm2-135m-hf"
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    main_py = os.environ.get("HISPARSE_MAIN_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    py = main_py if pathlib.Path(main_py).exists() else sys.executable
    tmp = tmp_path_factory.mktemp("export") / "hf"
    # `hisparse export --model smollm2-135m --format hf DIR`, in the main env's Python
    code = "import sys; from hisparse_jax.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([py, "-c", code, "export", "--model", "smollm2-135m",
                          "--format", "hf", str(tmp)], check=False,
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0 and (tmp / "model.safetensors").is_file(), \
        (run.stdout + run.stderr)[-3000:]
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)
