"""The `vllm.general_plugins` entry point (pyproject.toml:
`hisparse = "bridge.plugin:register"`). vLLM calls it in every process it starts,
before it parses its arguments.

- Registers the `HISPARSE` attention backend (`--attention-backend HISPARSE`, the
  GPU path).
- With HISPARSE_VLLM_CPU=1, also overrides `CPU_ATTN`, the only backend vLLM's
  CPU platform uses, so that a CPU engine runs on HiSparse. Without it, installing
  hisparse never changes what vLLM runs.

Cheap and idempotent: it imports only vLLM's backend registry (class paths are
strings; the backend modules load when vLLM picks them).
"""

from __future__ import annotations

import os

BACKEND = "bridge.vllm_backend.HiSparseBackend"
CPU_BACKEND = "bridge.vllm_cpu.HiSparseCPUBackend"
NAME = "HISPARSE"


def env_flag(name: str, env=None) -> bool:
    """A HISPARSE_* switch: 1, true, yes or on (any case) turn it on."""
    env = os.environ if env is None else env
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cpu_override_requested(env=None) -> bool:
    return env_flag("HISPARSE_VLLM_CPU", env)


def register() -> list[str]:
    """Register the backends; returns the names it (re)registered."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    done = []
    member = AttentionBackendEnum.__members__.get(NAME)
    if member is None:
        register_backend(NAME, BACKEND)
    else:
        register_backend(member, BACKEND)
    done.append(NAME)
    if cpu_override_requested():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        done.append("CPU_ATTN")
    return done
