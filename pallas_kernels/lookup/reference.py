"""Hashed-key lookup, pure jnp: digest scores of every candidate page."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Score every pool page (then gather) when the pool has at most this many times a
# sequence's page-table length. A model's layer loop copies its layer's slice of
# the pool's digests before the pool dot, so the break-even in SmolLM2's decode
# step lies between 3.7x and 5.6x (docs/log/serving.md, "Decode width");
# it is a constant of the cache, never of the batch, so that a sequence's
# scores do not depend on the decode width (the two paths differ in rounding).
POOL_SCORING_RATIO = 4


def page_scores(q: jax.Array, digest_center: jax.Array, digest_radius: jax.Array,
                page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two digest scores per page, from logits q.k / sqrt(D):

    bound:  per query head, q.c + |q|.r = sum_d max(q_d*lo_d, q_d*hi_d), Quest's
            upper bound on q.k over the page (finds pages with a few spiking
            keys); kept per head so each head gets its own top pages;
    center: q.c, the page's typical logit; each head's centres become a softmax
            over pages (its estimated mass shares) and the group's shares are
            summed (log): ranks spread mass, and a head with a large query norm
            cannot drown the others.

    Two dots of bf16 digests (the e4m3 radius widened exactly to bf16) with the query rounded to bf16, accumulated in f32
    (~3 significant digits in q: plenty for ranking pages).

    q:             [B, Hkv, G, D] float  (query heads grouped by their KV head)
    digest_center: [Hkv, P, D] bf16      per-channel key range centre of each pool page
    digest_radius: [Hkv, P, D] e4m3      ... and half-width
    page_table:    [B, N] int32          logical page -> pool page, -1 = not a candidate
    returns        bound [B, Hkv, G, N] and center [B, Hkv, N] float32, -inf for
                   non-candidates
    """
    # Scoring the whole pool and gathering the scores is faster on XLA:CPU than
    # gathering digest rows first (docs/log/code-timings.md, "pool scores") (the row gather copies every digest byte), as long
    # as the pool is not much larger than one sequence's table (batch-1 caches, or a
    # few long sequences); otherwise only each sequence's own pages are scored.
    score_pool = digest_center.shape[1] <= POOL_SCORING_RATIO * page_table.shape[1]
    b = q.shape[0]
    if b == 1 and not score_pool:  # XLA:CPU runs one sequence's gathered dots in
        # another order than two or more: a slot's scores would depend on the batch
        q, page_table = jnp.concatenate([q, q]), jnp.concatenate([page_table, page_table])
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))).transpose(1, 0, 2, 3)
    ids = jnp.maximum(page_table, 0)

    def dot(rows, digest):  # head-major batch dims: the layout XLA:CPU runs fastest
        rows, digest = rows.astype(jnp.bfloat16), digest.astype(jnp.bfloat16)  # e4m3 exact
        if score_pool:
            scores = jnp.einsum("hbgd,hpd->hbgp", rows, digest,
                                preferred_element_type=jnp.float32)
            return jnp.take_along_axis(scores, ids[None, :, None, :], axis=3)
        pages = jnp.take(digest, ids, axis=1)  # [Hkv, B, N, D]
        return jnp.einsum("hbgd,hbnd->hbgn", rows, pages, preferred_element_type=jnp.float32)

    center = dot(q, digest_center)
    bound = center + dot(jnp.abs(q), digest_radius)
    ok = page_table[None, :, None, :] >= 0

    def one(x, ok):  # one sequence: [Hkv, G, N] -> [Hkv, N]
        x = jnp.where(ok, x, -jnp.inf)
        x = x - jax.nn.logsumexp(x, axis=2, keepdims=True)
        return jnp.where(ok, jax.nn.logsumexp(x, axis=1, keepdims=True), -jnp.inf)[:, 0]

    def mass(x):  # [Hkv, B, G, N] -> [B, Hkv, N]: sum over the group of each head's
        # softmax over pages (its estimated mass shares), in log space. One sequence
        # at a time: XLA:CPU sums a row in another order once a reduction passes
        # ~4,096 elements, and a sequence's mass must not depend on how many are
        # scored beside it (a decode step over 4 slots must equal one over 8).
        return jax.lax.map(lambda a: one(*a), (x.transpose(1, 0, 2, 3),
                                               ok.transpose(1, 0, 2, 3)))

    return jnp.where(ok, bound, -jnp.inf).transpose(1, 0, 2, 3)[:b], mass(center)[:b]
