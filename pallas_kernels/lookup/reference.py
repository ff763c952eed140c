"""Hashed-key lookup, pure jnp: digest scores of every candidate page."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def page_scores(q: jax.Array, digest_min: jax.Array, digest_max: jax.Array,
                page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two digest scores per page, in logit units, GQA group combined by log-sum-exp
    (the group's attention mass adds up):

    bound:  q.center + |q|.radius == sum_d max(q_d*lo_d, q_d*hi_d), Quest's upper
            bound on q.k over the page (finds pages with a few spiking keys);
    center: q.center (estimates the page's typical logit; ranks spread mass).

    q:          [B, Hkv, G, D] float  (query heads grouped by their KV head)
    digest_min: [P, Hkv, D] bf16      per-channel key minimum of each pool page
    digest_max: [P, Hkv, D] bf16
    page_table: [B, N] int32          logical page -> pool page, -1 = not a candidate
    returns     (bound, center), each [B, Hkv, N] float32, -inf for non-candidates
    """
    ids = jnp.maximum(page_table, 0)
    lo = digest_min[ids].astype(jnp.float32)  # [B, N, Hkv, D]
    hi = digest_max[ids].astype(jnp.float32)
    q = q.astype(jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))
    # Materialize centre/radius, then a broadcast multiply-sum rather than einsum:
    # the fastest of the forms measured on XLA:CPU (a G-row dot runs slowly there).
    mid, rad = jax.lax.optimization_barrier(((hi + lo) * 0.5, (hi - lo) * 0.5))
    qb = q[:, None]  # [B, 1, Hkv, G, D]
    center = jnp.sum(qb * mid[:, :, :, None, :], axis=-1)  # [B, N, Hkv, G]
    bound = center + jnp.sum(jnp.abs(qb) * rad[:, :, :, None, :], axis=-1)
    bound, center = jax.lax.optimization_barrier((bound, center))
    ok = page_table[:, None, :] >= 0

    def combine(x):  # [B, N, Hkv, G] -> [B, Hkv, N]
        return jnp.where(ok, jax.nn.logsumexp(x, axis=3).transpose(0, 2, 1), -jnp.inf)

    return combine(bound), combine(center)
