"""Shared by the bridge's tests (imported as `bridge_helpers`: this folder is on
sys.path under pytest's default import mode)."""

from __future__ import annotations

import os
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# JAX's compile cache for the bridge's processes (the engines compile the same
# HiSparse programs every start; keyed by program and jax version).
BRIDGE_JAX_CACHE = ROOT / ".pytest_cache" / "jax-bridge"


def bridge_env(**extra) -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(BRIDGE_JAX_CACHE))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update({k: str(v) for k, v in extra.items()})
    return env
