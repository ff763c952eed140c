"""The one place where the jax versions hisparse supports (0.10.2 to 0.11.2) differ.

hisparse runs on jax 0.10.2 (the bridge environment: Python 3.11, vLLM's CPU build)
and on 0.11.2 (the main environment, Python 3.12). Everything else in the library
is the same code on both; tests/bridge/test_bridge_compat.py checks this module
under whichever jax runs it, and the bridge environment runs core tests on 0.10.2.

- `compute_on(compute_type=..., out_memory_spaces=...)`, the decorator that places
  a computation (and its outputs' memory space) on the host: jax 0.11 names it
  `jax.experimental.compute_on.compute_on`; jax 0.10 calls that one `compute_on2`
  and keeps `compute_on` for the older context manager that takes only
  `compute_type`.
"""

from __future__ import annotations

import jax.experimental.compute_on as _compute_on_mod

JAX_010 = hasattr(_compute_on_mod, "compute_on2")

if JAX_010:  # jax 0.10.x: the decorator with out_memory_spaces is compute_on2
    compute_on = _compute_on_mod.compute_on2
else:  # jax >= 0.11
    compute_on = _compute_on_mod.compute_on

__all__ = ["JAX_010", "compute_on"]
