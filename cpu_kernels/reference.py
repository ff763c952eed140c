"""Pure-jnp references for the CPU kernels that have no Pallas twin (the decode
kernels' references are pallas_kernels/sparse_decode/reference.py's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def causal_attention(q, k, v, start, *, sm_scale=None, layer=None):
    """Exact causal attention of a block of queries over the keys before them, in
    float32: q [T, Hq, D] with query i at position start + i; k, v [S, Hkv, D]
    (Hq a multiple of Hkv), or k[layer], v[layer] of stacked [L, S, Hkv, D] ->
    [T, Hq, D], query i over keys 0..min(start+i, S-1). The scaled query is
    rounded to float32 first, as the prefill's `attention.query_rows` does."""
    if layer is not None:
        k, v = k[layer], v[layer]
    t, hq, d = q.shape
    s, hkv = k.shape[:2]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    qg = (q.astype(jnp.float32) * np.float32(scale)).reshape(t, hkv, hq // hkv, d)
    logits = jnp.einsum("thgd,shd->hgts", qg, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    pos = jnp.minimum(start + jnp.arange(t), s - 1)
    logits = jnp.where(jnp.arange(s)[None, :] <= pos[:, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("hgts,shd->thgd", p, v.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(t, hq, d)


def matmul(x, w, layer=None):
    """A weight product: x [M, K] times w [N, K] (layer None) or w[layer] of stacked
    weights [L, N, K], transposed -> [M, N] float32. x is rounded to bf16 and the
    products of bf16 are summed in float32, as the model's XLA products do."""
    wl = w if layer is None else w[layer]
    return jax.lax.dot_general(x.astype(jnp.bfloat16), wl.astype(jnp.bfloat16),
                               (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
