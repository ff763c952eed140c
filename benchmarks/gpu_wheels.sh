#!/usr/bin/env bash
# The wheels the H200 image lacks for benchmarks/gpu_check.py --model-steps (it has
# jax 0.11.2 + CUDA, flax, numpy, jinja2, tokenizers, safetensors, httpx,
# prometheus_client, tqdm; no network), at the versions .venv runs, for Python 3.12.
# Usage: benchmarks/gpu_wheels.sh [DIR]   (default .whl, git-ignored). On the device,
# from the repository root, first:
#   python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
#   export PYTHONPATH=$PWD/.site
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
pkgs="mmh3 gguf fastapi starlette pydantic pydantic_core typing-inspection annotated-types
      annotated-doc uvicorn opentelemetry-api typing_extensions"
mkdir -p "$dir"
for p in $pkgs; do
    v=$(.venv/bin/python -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$v" ] || { echo "gpu_wheels: $p is not in .venv (run make venv)" >&2; exit 1; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$p==$v"
done
ls "$dir"
