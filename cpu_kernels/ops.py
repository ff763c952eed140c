"""The CPU kernels with their references' signatures
(pallas_kernels/sparse_decode/reference.py, and pallas_kernels/lookup/reference.py
for `page_scores`), plus `layer`: given a layer index, the
pool arrays carry a leading layer axis and the kernel reads that layer in place
(a layer of a stacked cache, which XLA would otherwise copy whole for the call).

They compute the same functions as the references, with other rounding: sums in
another order and exp by a polynomial (about 1 ulp), so outputs agree within
2e-5 relative (tests/test_cpu_kernels.py), not bitwise. Each (sequence, KV head) is computed alone, in the same
order whatever the batch, so a sequence's numbers never depend on the others'.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build


def _pool(arrays, layer):
    """Pool arrays with a layer axis, and the layer's index."""
    if layer is None:
        return [a[None] for a in arrays], jnp.zeros((), jnp.int32)
    return list(arrays), jnp.asarray(layer, jnp.int32)


def _e4m3(r):
    """e4m3 radii as they are: float8_e4m3fn, or its bits as uint8 (a stacked
    cache's stored form; the kernel reads both, so no converted copy is made)."""
    if r.dtype not in (jnp.float8_e4m3fn, jnp.uint8):
        raise TypeError(f"digest_radius must be float8_e4m3fn or its uint8 bits, got {r.dtype}")
    return r


def _call(target, out_shapes, *args, **attrs):
    why = build.unavailable()
    if why:
        raise RuntimeError(why)
    return jax.ffi.ffi_call(target, out_shapes)(*args, **attrs)


def cold_logits(q, int4_k, digest_center, digest_radius, cold_ids, layer=None):
    """`ref.cold_logits`: q.k [B, Hkv, G, K, T] (unscaled) of the int4 pages
    `cold_ids` [B, Hkv, K] (0 where -1)."""
    (k, c, r), layer = _pool((int4_k, digest_center, digest_radius), layer)
    shape = q.shape[:3] + (cold_ids.shape[-1], k.shape[3])
    return _call("hisparse_cold_logits", jax.ShapeDtypeStruct(shape, jnp.float32),
                 q.astype(jnp.float32), k, c.astype(jnp.bfloat16), _e4m3(r),
                 cold_ids.astype(jnp.int32), layer)


def attend_listed(raw, picked, ids, logw, window_out, window_lse, int4_v, int4_v_scale,
                  int4_v_zero, *, sm_scale, layer=None):
    """`ref.attend_listed`: the picked pages' softmax merged with the window's
    -> (out [B, Hkv, G, D], lse [B, Hkv, G])."""
    (v, s, z), layer = _pool((int4_v, int4_v_scale, int4_v_zero), layer)
    return _call("hisparse_attend_listed",
                 (jax.ShapeDtypeStruct(window_out.shape, jnp.float32),
                  jax.ShapeDtypeStruct(window_lse.shape, jnp.float32)),
                 raw.astype(jnp.float32), picked.astype(jnp.int32), ids.astype(jnp.int32),
                 logw.astype(jnp.float32), window_out.astype(jnp.float32),
                 window_lse.astype(jnp.float32), v, s.astype(jnp.bfloat16),
                 z.astype(jnp.bfloat16), layer, sm_scale=np.float32(sm_scale))


def window_parts(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
                 fp8_valid, sm_scale, layer=None):
    """`ref.window_parts`: [(out, lse)] of the window, its bf16 and fp8 tiers in one
    softmax (one part, where the reference has one per tier)."""
    (bk, bv, fk, fv, fks, fvs), layer = _pool(
        (bf16_k, bf16_v, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale), layer)
    head = q.shape[:3]
    return [_call("hisparse_window",
                  (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct(head, jnp.float32)),
                  q.astype(jnp.float32), bk.astype(jnp.bfloat16), bv.astype(jnp.bfloat16),
                  bf16_valid.astype(bool), _e4m3(fk), _e4m3(fv), fks.astype(jnp.float32),
                  fvs.astype(jnp.float32), fp8_valid.astype(bool), layer,
                  sm_scale=np.float32(sm_scale))]


def page_scores(q, digest_center, digest_radius, page_table, layer=None):
    """`lookup_ref.page_scores` (pallas_kernels/lookup/reference.py): Quest's bound
    [B, Hkv, G, N] and the group's log estimated mass [B, Hkv, N] of each page of
    `page_table` [B, N] for grouped queries q [B, Hkv, G, D], -inf where the table
    is -1. The query is scaled and rounded to bf16 here, as the reference does."""
    (c, r), layer = _pool((digest_center, digest_radius), layer)
    rows = (q.astype(jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))).astype(jnp.bfloat16)
    b, h, g, _ = q.shape
    n = page_table.shape[-1]
    return _call("hisparse_page_scores",
                 (jax.ShapeDtypeStruct((b, h, g, n), jnp.float32),
                  jax.ShapeDtypeStruct((b, h, n), jnp.float32)),
                 rows, c.astype(jnp.bfloat16), _e4m3(r), page_table.astype(jnp.int32), layer)


def rank_pages(bound, ranked, page_table, lead, *, per_head, k, quest):
    """`attention.selection._rank`'s candidates from its scores, the same pages as XLA's:
    bound [B, Hkv, G, N] and ranked [B, Hkv, N] (the stickiness bonus added),
    page_table [B, N], lead [B, Hkv] (how many of plain Quest's top pages lead the
    group; read if `quest`) -> [B, Hkv, k] int32 logical pages in page order, -1
    last. per_head: each query head's top bound pages."""
    b, h = ranked.shape[:2]
    return _call("hisparse_rank_pages", jax.ShapeDtypeStruct((b, h, k), jnp.int32),
                 bound.astype(jnp.float32), ranked.astype(jnp.float32),
                 page_table.astype(jnp.int32), lead.astype(jnp.int32),
                 per_head=np.int64(per_head), k=np.int64(k), quest=bool(quest))


def sample_tail(mass, pages, offsets, *, n_u, n_s):
    """`attention.sample_tail`'s draws from its offsets [B, 2, Hkv]: mass [B, Hkv,
    N], the selection pages [B, Hkv, K] -> (pages [B, Hkv, n_u + n_s] int32, -1 =
    none; log weights f32, 0 where none). The same uniform draws; the weighted ones
    are the same but where a draw falls within rounding of a page's edge."""
    b, h = mass.shape[:2]
    shape = (b, h, n_u + n_s)
    return _call("hisparse_sample_tail", (jax.ShapeDtypeStruct(shape, jnp.int32),
                                          jax.ShapeDtypeStruct(shape, jnp.float32)),
                 mass.astype(jnp.float32), pages.astype(jnp.int32),
                 offsets.astype(jnp.float32), n_u=np.int64(n_u), n_s=np.int64(n_s))


def rerank(raw, slots, window_lse, q, int4_k, digest_center, digest_radius, offsets, *, k, m,
           sm_scale, floor, slack, uniform_share, mass_weight, layer=None):
    """`attention.rerank` of the candidates at pool `slots` [B, Hkv, C] from
    `cold_logits` raw [B, Hkv, G, L >= C, T] (theirs first), the window's log-sum-exp
    [B, Hkv, G] and the sample's offsets [B, Hkv]; the floor's Quest bounds from q
    [B, Hkv, G, D] and the pool (`attention.candidate_bounds`) where a group has a
    sharp head (floor >= 1: no floor) -> (kept [B, Hkv, k], drawn [B, Hkv, m]: indices
    into the candidates, -1 = none; drawn_logw [B, Hkv, m] f32)."""
    (kc, c, r), layer = _pool((int4_k, digest_center, digest_radius), layer)
    b, h = slots.shape[:2]
    return _call("hisparse_rerank",
                 (jax.ShapeDtypeStruct((b, h, k), jnp.int32),
                  jax.ShapeDtypeStruct((b, h, m), jnp.int32),
                  jax.ShapeDtypeStruct((b, h, m), jnp.float32)),
                 raw.astype(jnp.float32), slots.astype(jnp.int32),
                 window_lse.astype(jnp.float32), q.astype(jnp.float32), kc,
                 c.astype(jnp.bfloat16), _e4m3(r), layer, offsets.astype(jnp.float32),
                 sm_scale=np.float32(sm_scale), floor=np.float32(floor),
                 slack_share=np.float32(slack), uniform_share=np.float32(uniform_share),
                 mass_weight=bool(mass_weight))


def sparse_decode(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
                  fp8_valid, int4_k, int4_v, int4_v_scale, int4_v_zero, digest_center,
                  digest_radius, cold_ids, *, sm_scale, cold_logw=None, layer=None):
    """`ref.sparse_decode` on the CPU kernels: the window, the pages' logits, and
    the softmax over all of them (every page listed is attended)."""
    q = q.astype(jnp.float32)
    if cold_logw is None:
        cold_logw = jnp.zeros(cold_ids.shape, jnp.float32)
    [window] = window_parts(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale,
                            fp8_v_scale, fp8_valid, sm_scale, layer)
    raw = cold_logits(q, int4_k, digest_center, digest_radius, cold_ids, layer)
    every = jnp.broadcast_to(jnp.arange(cold_ids.shape[-1], dtype=jnp.int32), cold_ids.shape)
    return attend_listed(raw, every, cold_ids, cold_logw, *window, int4_v, int4_v_scale,
                         int4_v_zero, sm_scale=sm_scale, layer=layer)


def causal_attention(q, k, v, start, *, sm_scale=None, layer=None, amx=True):
    """`reference.causal_attention` on the CPU (`build.causal_unavailable` says
    where it runs): q [T, Hq, D] at positions start.., k, v [S, Hkv, D] bf16, or
    k[layer], v[layer] of stacked [L, S, Hkv, D] read in place -> [T, Hq, D]
    float32; a query's output does not depend on the other queries in the call. On
    AMX tiles (where the CPU has them and `amx`): its queries split into three bf16
    terms, its probabilities into two. Else on AVX-512: float32 multiply-adds.
    Either way within 1e-5 of the float32 reference (the products exact, the sums
    in another order)."""
    why = build.causal_unavailable()
    if why:
        raise RuntimeError(why)
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    if layer is None:
        k, v, layer = k[None], v[None], 0
    return jax.ffi.ffi_call("hisparse_causal_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
        jnp.asarray(layer, jnp.int32), jnp.asarray(start, jnp.int32),
        sm_scale=np.float32(scale), amx=np.int32(bool(amx)))


AVX512_MAX_ROWS = 16  # without AMX, the kernel's products of at most this many rows


def matmul_unsupported(rows: int, k: int, n: int, amx: bool = True) -> str | None:
    """Why `matmul` cannot take x [rows, k] and weights of n outputs (None if it can;
    amx False: on its AVX-512 path)."""
    if rows < 1:
        return f"at least 1 row, got {rows}"
    if k % 32 or n % 16:
        return f"inputs a multiple of 32 and outputs of 16, got {k} and {n}"
    if rows > AVX512_MAX_ROWS and (not amx or build.amx_unavailable()):
        return f"more than {AVX512_MAX_ROWS} rows need AMX-BF16 tiles, got {rows}"
    return None


def matmul(x, w, layer=None, *, amx=True):
    """`reference.matmul` on the CPU (`build.products_unavailable` says where it
    runs): x [M, K] times w [N, K], or w[layer] of stacked weights [L, N, K] read
    in place, transposed -> [M, N] float32; each row's result is independent of
    the other rows. On AMX tiles (where the CPU has them and `amx`): the same
    products summed in the same order as XLA:CPU's bf16 dot there (bit-equal in
    tests/test_cpu_matmul.py). Else on AVX-512, up to AVX512_MAX_ROWS rows: the
    same products summed in another order (within float32's rounding)."""
    why = build.products_unavailable() or matmul_unsupported(x.shape[0], x.shape[1],
                                                             w.shape[-2], amx)
    if why:
        raise RuntimeError(why)
    w, layer = (w[None], 0) if layer is None else (w, layer)
    return jax.ffi.ffi_call("hisparse_matmul",
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), jnp.asarray(layer, jnp.int32),
        amx=np.int32(bool(amx)))


def matmul_blocks(x, codes, scales, layer=None, *, amx=True):
    """`matmul` of weights in GGUF blocks (cpu_kernels/blocks.py's tiles: codes [N /
    16, K / 32, R, 32] and scales [N / 16, K / 32, S, 16], or stacks of them with a
    leading layer axis read at `layer`): x [M, K] with M at most 16 -> [M, N]
    float32, bit-equal to `matmul` of `blocks.dequantize(codes, scales)` on the
    same path (`amx`)."""
    rows = x.shape[0]
    why = (build.products_unavailable() or (rows > 16 and f"at most 16 rows, got {rows}")
           or matmul_unsupported(rows, x.shape[1], 16))
    if why:
        raise RuntimeError(why)
    if layer is None:
        codes, scales, layer = codes[None], scales[None], 0
    n = codes.shape[1] * 16
    return jax.ffi.ffi_call("hisparse_matmul_blocks",
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x.astype(jnp.bfloat16), codes.astype(jnp.uint8), scales.astype(jnp.float16),
        jnp.asarray(layer, jnp.int32), amx=np.int32(bool(amx)))
