"""Shared by the bridge's tests (imported as `bridge_helpers`: this folder is on
sys.path under pytest's default import mode)."""

from __future__ import annotations

import os
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def bridge_env(**extra) -> dict:
    """The engines' environment: this process's (with the suite's JAX compile
    cache, tests/conftest.py: the engines compile the same HiSparse programs every
    start) and small vLLM settings."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update({k: str(v) for k, v in extra.items()})
    return env
