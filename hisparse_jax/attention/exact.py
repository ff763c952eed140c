"""Exact attention on unquantized K/V: one query per sequence (the quality and
speed baseline, `dense_decode_attention`, and the dense engine's float32
`float32_decode_attention`) and the causal prefill (`causal_prefill_attention`
of a whole prompt, `causal_block_attention` of one query block of it), every
exact prefill through one body (`causal_query_block`)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import backends

PREFILL_CHUNK = 512  # the causal prefill's query/key block: prompts are padded to it


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


def float32_decode_attention(q, k, v, lengths):
    """Exact decode attention over a bf16 cache, in float32 (`dense_decode_attention`
    rounds q and the probabilities to the cache's dtype, which moved SmolLM2's
    logits against float32 attention): the dense engine's baseline.
    q [B, Hq, D]; k, v [B, Hkv, S, D]; lengths [B] -> [B, Hq, D] float32."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(jnp.float32)) / np.sqrt(d)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhgs,bhsd->bhgd", p, v.astype(jnp.float32)).reshape(b, hq, d)


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
                             chunk: int = PREFILL_CHUNK) -> jax.Array:
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


def causal_block_attention(q, k, v, start, chunk: int, prefill: str, layer=None):
    """Exact causal attention of queries q [C, Hq, D] at positions start..start+C
    over k, v [S, Hkv, D] (bf16), or k[layer], v[layer] of a stack [L, S, Hkv, D]
    read where it lies (a chunked prefill's staged K/V: slicing a layer out would
    copy all of it every block) -> [C, Hq, D] float32, on the CPU kernel (prefill
    "cpu", `backends.resolve("causal_attention", ...)`: AMX tiles or AVX-512) or in XLA
    (`causal_query_block`, key blocks of `chunk`, start a multiple of it, C at
    most `chunk`; start a Python 0: a whole prompt, `causal_prefill_attention`).
    Each query's output is the same whatever block it is computed in, so a prompt
    prefilled block by block gets the numbers of one program."""
    return backends.kernel("causal_attention", prefill)(q, k, v, start, chunk, layer)


def _causal_why_not(head_dim: int, **_) -> str | None:
    why = backends.cpu_kernel_why_not("causal_unavailable")()
    if why is None and (head_dim % 64 or head_dim > 256):
        why = f"the causal kernel takes head dims of 64, 128, 192 or 256, not {head_dim}"
    return why


def _causal_label() -> str:
    from cpu_kernels import build
    return f"the CPU kernel, {build.causal_path()}"


@backends.register("causal_attention", "cpu", why_not=_causal_why_not, strict=False,
                   label=_causal_label)
def _causal_block_cpu(q, k, v, start, chunk, layer):
    """cpu_kernels/causal_attention.cc: on AMX tiles, or on AVX-512."""
    from cpu_kernels import ops
    return ops.causal_attention(q, k, v, start, layer=layer)


@backends.register("causal_attention", "xla", label="XLA")
def _causal_block_reference(q, k, v, start, chunk, layer):
    if isinstance(start, int):  # a whole prompt (from 0): its own K/V, never a stack
        return causal_prefill_attention(q, k, v, chunk=chunk)
    if layer is None:
        k, v, layer = k[None], v[None], 0
    kv = lambda j: tuple(jax.lax.dynamic_slice(s, (layer, j * chunk, 0, 0), (1, chunk, *s.shape[2:]))[0]
                         .astype(jnp.float32).transpose(1, 0, 2) for s in (k, v))
    # A prompt's last block may be shorter: its queries are padded back to a whole
    # block here, because XLA's products of fewer rows sum differently, which flips
    # bf16 roundings of later layers' K/V (and moves the logits)
    c = q.shape[0]
    q = jnp.pad(q, ((0, chunk - c), (0, 0), (0, 0)))
    out = causal_query_block(query_rows(q, k.shape[2]), kv, start // chunk, chunk)
    return query_rows_back(out, chunk)[:c]
