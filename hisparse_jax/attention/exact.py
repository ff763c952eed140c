"""Exact attention on unquantized K/V: one query per sequence (the quality and
speed baseline) and the causal prefill."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


@jax.jit
def dense_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           lengths: jax.Array) -> jax.Array:
    """Exact attention on unquantized K/V: the quality and speed baseline.

    q [B, Hq, D]; k, v [B, Hkv, S, D] (any float dtype, read as is); lengths [B].
    returns [B, Hq, D] float32.
    """
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(k.dtype)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    logits = jnp.where(valid, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(valid, p, 0.0)
    out = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, d)


def causal_query_block(qi: jax.Array, kv_block, i: jax.Array, chunk: int) -> jax.Array:
    """Exact causal attention of query block i over key blocks 0..i: the one body
    of every exact prefill (`causal_prefill_attention`, and the serving engine's
    block-by-block prefill, which must give the same numbers).

    qi [Hkv, G*C, D] float32, already scaled by 1/sqrt(D), rows ordered (group,
    position), so that each KV head is one plain matmul (the [C, Hkv, G, D] layout
    transposed operands in every block: 2.2x slower here,
    `benchmarks/prefill_attention_variants.py`); kv_block(j) -> (k, v) [Hkv, C, D]
    float32, key block j. Online softmax over the key blocks. -> [Hkv, G*C, D].
    """
    hkv, rows, d = qi.shape
    qpos = jnp.tile(jnp.arange(chunk), rows // chunk)

    def step(carry, j, diagonal: bool):
        m, l, acc = carry
        k, v = kv_block(j)
        s = jnp.einsum("hqd,hkd->hqk", qi, k)
        if diagonal:  # only the diagonal block has future keys
            s = jnp.where(jnp.arange(chunk)[None, :] <= qpos[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        return (m_new, l * corr + jnp.sum(p, -1),
                acc * corr[..., None] + jnp.einsum("hqk,hkd->hqd", p, v))

    init = (jnp.full((hkv, rows), -jnp.inf), jnp.zeros((hkv, rows)), jnp.zeros((hkv, rows, d)))
    # the blocks before the diagonal unmasked (a mask there keeps every key: 14%
    # of a 7.5K prompt's attention, `benchmarks/prefill_attention_variants.py`)
    carry = jax.lax.fori_loop(0, i, lambda j, c: step(c, j, False), init)
    _, l, acc = step(carry, i, True)
    return acc / l[..., None]


def query_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """Query block q [C, Hq, D] -> [Hkv, G*C, D] float32 scaled by 1/sqrt(D), as
    `causal_query_block` takes it."""
    c, hq, d = q.shape
    g = hq // num_kv_heads
    q = q.astype(jnp.float32) * (1.0 / math.sqrt(d))
    return q.reshape(c, num_kv_heads, g, d).transpose(1, 2, 0, 3).reshape(num_kv_heads, g * c, d)


def query_rows_back(out: jax.Array, chunk: int) -> jax.Array:
    """`causal_query_block`'s [Hkv, G*C, D] -> [C, Hq, D]."""
    hkv, rows, d = out.shape
    g = rows // chunk
    return out.reshape(hkv, g, chunk, d).transpose(2, 0, 1, 3).reshape(chunk, hkv * g, d)


@functools.partial(jax.jit, static_argnames=("chunk",))
def causal_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                             chunk: int = 512) -> jax.Array:
    """Exact causal attention for a prompt, chunked so memory is O(chunk^2), not O(T^2).

    q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D] float32. T must be a multiple of
    `chunk` (pad the prompt; padded keys come after every real query, so causality
    already hides them). Online softmax over key chunks, skipping chunks in the
    future (`causal_query_block`).
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    n = t // chunk
    qb = jax.vmap(lambda x: query_rows(x, hkv))(q.reshape(n, chunk, hq, d))
    kc, vc = (x.astype(jnp.float32).reshape(n, chunk, hkv, d).transpose(0, 2, 1, 3)
              for x in (k, v))
    out = jax.lax.map(
        lambda a: query_rows_back(causal_query_block(a[1], lambda j: (kc[j], vc[j]), a[0], chunk), chunk),
        (jnp.arange(n), qb))
    return out.reshape(t, hq, d)
