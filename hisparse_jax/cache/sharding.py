"""Sharding the cache and the decode path over KV heads (a named mesh axis).

Every per-head array of `CacheState` is split on its KV-head dimension; page
tables, lengths and the free stack are replicated (they are per sequence). The
jitted functions in `state` and `attention` run unchanged: XLA's partitioner
(GSPMD) keeps each head's work on the device that holds the head, since nothing
mixes KV heads except the final reshape of the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax.cache.state import CacheState
from hisparse_jax.config import HiSparseConfig

AXIS = "kv"

# Which dimension of each field holds the KV heads (None: replicated).
_HEAD_DIM = {
    "bf16_k": 1, "bf16_v": 1, "fp8_k": 1, "fp8_v": 1, "fp8_k_scale": 1, "fp8_v_scale": 1,
    "int4_k": 0, "int4_v": 0, "int4_v_scale": 0, "int4_v_zero": 0,
    "digest_center": 0, "digest_radius": 0,
    "page_table": None, "seq_lens": None, "free_pages": None, "num_free": None,
    "refcount": None, "last_selected": 1, "poisoned": None,
}


def kv_mesh(cfg: HiSparseConfig, devices=None) -> Mesh:
    """A 1-D mesh named `kv` over `devices` (default: all), which must divide the KV heads."""
    devices = list(jax.devices() if devices is None else devices)
    if cfg.num_kv_heads % len(devices):
        raise ValueError(f"{len(devices)} devices do not divide num_kv_heads="
                         f"{cfg.num_kv_heads}")
    return Mesh(np.array(devices), (AXIS,))


def _spec(field: str, ndim: int) -> P:
    dim = _HEAD_DIM[field]
    if dim is None:
        return P()
    return P(*([None] * dim + [AXIS] + [None] * (ndim - dim - 1)))


def state_sharding(state: CacheState, mesh: Mesh) -> CacheState:
    """A CacheState-shaped tree of NamedShardings."""
    fields = {name: NamedSharding(mesh, _spec(name, getattr(state, name).ndim))
              for name in _HEAD_DIM}
    return state.replace(**fields)


def shard_state(state: CacheState, mesh: Mesh) -> CacheState:
    """A sharded copy (never aliasing `state`: its buffers are donated by updates)."""
    # device_put may reuse a buffer for a replicated field even with may_alias=False.
    return jax.device_put(jax.tree.map(jnp.copy, state), state_sharding(state, mesh))


def query_sharding(mesh: Mesh) -> NamedSharding:
    """q [B, Hq, D]: query heads are grouped by KV head, so split Hq the same way."""
    return NamedSharding(mesh, P(None, AXIS))
