"""Sparse decode attention over the attended set, pure jnp.

Three parts, each dequantized where it is read and reduced to (output, lse):
bf16 tokens (sink + hot), fp8 tokens (warm), selected int4 pages (cold). The
parts are merged by log-sum-exp. Masked slots may hold anything (NaN included):
they are removed with `where`, never by multiplying with zero.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.quant.reference import INT4_LEVELS, decode_fp8


def row_sum(x):
    """x summed over its last axis, in an order that does not depend on the other
    axes' sizes. XLA:CPU sums a row (`jnp.sum`) in an order that depends on how
    many rows there are, so a sequence's softmax sums changed with the number of
    sequences beside it (a decode step over 1 slot against 4: served alone must
    equal served in a batch, `state.decode_widths`). A chain of adds (a short
    row) and a cumulative sum's last element are computed row by row alike."""
    if x.shape[-1] == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)
    if x.shape[-1] <= 32:
        out = x[..., 0]
        for i in range(1, x.shape[-1]):
            out = out + x[..., i]
        return out
    return jnp.cumsum(x, axis=-1)[..., -1]


def attend_part(q, k, v, valid, sm_scale):
    """q [B,Hkv,G,D]; k, v [B,Hkv,T,D] f32; valid [B,Hkv,T] bool ->
    (out [B,Hkv,G,D] f32, lse [B,Hkv,G] f32, -inf when nothing is valid)."""
    logits = jnp.einsum("bhgd,bhtd->bhgt", q, jnp.where(valid[..., None], k, 0.0)) * sm_scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    denom = row_sum(p)
    out = jnp.einsum("bhgt,bhtd->bhgd", p, jnp.where(valid[..., None], v, 0.0))
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse


def merge_parts(parts):
    """Combine [(out, lse), ...] of disjoint token sets into one softmax output."""
    lses = jnp.stack([lse for _, lse in parts])  # [n, B, Hkv, G]
    m = jnp.max(lses, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m_safe)  # exp(-inf) = 0 for empty parts
    total = jnp.sum(w, axis=0)
    out = sum(wi[..., None] * o for wi, (o, _) in zip(w, parts))
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out, lse


def cold_logits(q, int4_k, digest_center, digest_radius, cold_ids, layer=None):
    """q.k [B, Hkv, G, K, T] (unscaled) of the int4 pages `cold_ids` [B, Hkv, K],
    without building dequantized K tiles: q.lo + (q * step).code per half. Codes are
    uint8 (always finite); the ranges of unselected slots (-1) are replaced by zeros,
    so stale pool data never leaks (mask their logits after). With `layer`, the pool
    arrays carry a leading layer axis and that layer is read (as the CPU kernels')."""
    if layer is not None:
        int4_k, digest_center, digest_radius = (
            a[layer] for a in (int4_k, digest_center, digest_radius))
    d = q.shape[-1]
    half = d // 2
    heads = jnp.arange(q.shape[1])[None, :, None]
    ok = cold_ids >= 0                                       # [B, Hkv, K]
    ids = jnp.maximum(cold_ids, 0)
    c = jnp.where(ok[..., None], digest_center[heads, ids].astype(jnp.float32), 0.0)
    r = jnp.where(ok[..., None], digest_radius[heads, ids].astype(jnp.float32), 0.0)
    lo, step = c - r, r * (2.0 / INT4_LEVELS)                # [B, Hkv, K, D]
    kc = int4_k[heads, ids]                                  # [B, Hkv, K, T, D/2] uint8
    qs = q[:, :, :, None, :] * step[:, :, None]              # [B, Hkv, G, K, D]
    return (jnp.einsum("bhgd,bhkd->bhgk", q, lo)[..., None]
            + jnp.einsum("bhgkc,bhktc->bhgkt", qs[..., :half], (kc & 0xF).astype(jnp.float32))
            + jnp.einsum("bhgkc,bhktc->bhgkt", qs[..., half:], (kc >> 4).astype(jnp.float32)))


def cold_values(p, int4_v, int4_v_scale, int4_v_zero, cold_ids):
    """sum_t p[..., k, t] v[k, t] [B, Hkv, G, D] over the int4 pages `cold_ids` [B,
    Hkv, K] for weights p [B, Hkv, G, K, T]: values dequantized (zero + code * scale
    per channel group) and one dot per head: on XLA:CPU faster than folding the
    scales into p, whose grouped dot needs a transposed copy of the codes
    (docs/log/code-timings.md, "cold values"). Unselected slots' scales and zeros
    read as zeros."""
    hkv = p.shape[1]
    heads = jnp.arange(hkv)[None, :, None]
    ok = cold_ids >= 0
    ids = jnp.maximum(cold_ids, 0)
    scale = jnp.where(ok[..., None, None], int4_v_scale[heads, ids].astype(jnp.float32), 0.0)
    zero = jnp.where(ok[..., None, None], int4_v_zero[heads, ids].astype(jnp.float32), 0.0)
    vc = int4_v[heads, ids]                                  # [B, Hkv, K, T, D/2] uint8
    codes = jnp.concatenate([vc & 0xF, vc >> 4], axis=-1).astype(jnp.float32)  # halves
    ng, d = scale.shape[-1], codes.shape[-1]
    v = codes.reshape(*codes.shape[:-1], ng, d // ng) * scale[..., None] + zero[..., None]
    return jnp.einsum("bhgkt,bhktd->bhgd", p, v.reshape(codes.shape))


def attend_cold(q, int4_k, int4_v, int4_v_scale, int4_v_zero, digest_center, digest_radius,
                cold_ids, cold_logw, sm_scale, layer=None):
    """Selected int4 pages -> (out, lse)."""
    logits = weighted_logits(cold_logits(q, int4_k, digest_center, digest_radius, cold_ids,
                                         layer), cold_ids, cold_logw, sm_scale)
    return attend_cold_logits(logits, int4_v, int4_v_scale, int4_v_zero, cold_ids, layer)


def weighted_logits(logits, cold_ids, cold_logw, sm_scale):
    """`cold_logits` [B, Hkv, G, K, T] -> the softmax's logits: scaled, plus each
    page's log weight `cold_logw` [B, Hkv, K] (None: none), -inf on unselected
    slots (-1)."""
    logits = logits * sm_scale
    if cold_logw is not None:
        logits = logits + cold_logw.astype(jnp.float32)[:, :, None, :, None]
    return jnp.where((cold_ids >= 0)[:, :, None, :, None], logits, -jnp.inf)


def attend_cold_logits(logits, int4_v, int4_v_scale, int4_v_zero, cold_ids, layer=None):
    """The int4 pages `cold_ids` [B, Hkv, K] given their final logits [B, Hkv, G, K,
    T] (scaled, weighted, -inf where masked) -> (out, lse). `layer`: as `cold_logits`'."""
    if layer is not None:
        int4_v, int4_v_scale, int4_v_zero = (
            a[layer] for a in (int4_v, int4_v_scale, int4_v_zero))
    m = jnp.max(logits, axis=(-2, -1))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m_safe[..., None, None])            # [B, Hkv, G, K, T]
    denom = row_sum(p.reshape(*p.shape[:3], -1))
    out = cold_values(p, int4_v, int4_v_scale, int4_v_zero, cold_ids)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse


def attend_listed(raw, picked, ids, logw, window_out, window_lse, int4_v, int4_v_scale,
                  int4_v_zero, *, sm_scale, layer=None):
    """The final softmax of a decode step whose pages were listed and re-ranked:
    the entries `picked` [B, Hkv, K] (indices into the pages of raw, -1 = none) of
    `cold_logits` raw [B, Hkv, G, C, T], at pool pages `ids` [B, Hkv, K] (-1 =
    none) with log weights `logw` [B, Hkv, K], merged with the window's softmax
    (window_out [B, Hkv, G, D], window_lse [B, Hkv, G]) -> (out, lse). The XLA
    path does this inline (hisparse_jax.attention); the CPU kernel's reference."""
    logits = weighted_logits(
        jnp.take_along_axis(raw, jnp.maximum(picked, 0)[:, :, None, :, None], axis=3),
        ids, logw, sm_scale)
    cold = attend_cold_logits(logits, int4_v, int4_v_scale, int4_v_zero, ids, layer)
    return merge_parts([(window_out, window_lse), cold])


def window_parts(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
                 fp8_valid, sm_scale, layer=None):
    """[(out, lse)] of the bf16 part and, if there is one, the fp8 part (arguments
    as `sparse_decode`'s; with `layer`, the tiers carry a leading layer axis)."""
    if layer is not None:
        bf16_k, bf16_v, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale = (
            a[layer] for a in (bf16_k, bf16_v, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale))
    q = q.astype(jnp.float32)
    hkv = q.shape[1]

    def tile(valid):  # [B, T] -> [B, Hkv, T]
        return jnp.broadcast_to(valid[:, None, :], (valid.shape[0], hkv, valid.shape[1]))

    parts = [attend_part(q, bf16_k.astype(jnp.float32), bf16_v.astype(jnp.float32),
                         tile(bf16_valid), sm_scale)]
    if fp8_k.shape[2]:
        parts.append(attend_part(q, decode_fp8(fp8_k, fp8_k_scale),
                                 decode_fp8(fp8_v, fp8_v_scale), tile(fp8_valid), sm_scale))
    return parts


def sparse_decode(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
                  fp8_valid, int4_k, int4_v, int4_v_scale, int4_v_zero, digest_center,
                  digest_radius, cold_ids, *, sm_scale, cold_logw=None, layer=None):
    """Decode attention of one query per sequence over its attended set.

    q:            [B, Hkv, G, D] float32
    bf16_k/v:     [B, Hkv, Tb, D] bf16     sink slots, then the hot ring
    bf16_valid:   [B, Tb] bool
    fp8_k/v:      [B, Hkv, Tw, D] e4m3     warm ring
    fp8_*_scale:  [B, Hkv, Tw] f32         one scale per token per head
    fp8_valid:    [B, Tw] bool
    int4_k/v:     [Hkv, P, page, D/2] u8   cold pool (half-split packed)
    int4_v_scale, int4_v_zero: [Hkv, P, page, D/group] bf16
    digest_center, digest_radius: [Hkv, P, D] bf16, e4m3  key range of each page (int4 key grid)
    cold_ids:     [B, Hkv, K] int32        selected pool pages, -1 = none
    cold_logw:    [B, Hkv, K] f32          log weight added to each cold page's logits
                                           (an importance-sampled page counts w times);
                                           None = 0
    layer:        None, or the layer to read of pool arrays with a leading layer axis
    returns (out [B, Hkv, G, D] f32, lse [B, Hkv, G] f32)
    """
    q = q.astype(jnp.float32)
    if cold_logw is None:
        cold_logw = jnp.zeros(cold_ids.shape, jnp.float32)
    parts = window_parts(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale,
                         fp8_v_scale, fp8_valid, sm_scale, layer)
    if cold_ids.shape[2]:
        parts.append(attend_cold(q, int4_k, int4_v, int4_v_scale, int4_v_zero, digest_center,
                                 digest_radius, cold_ids, cold_logw, sm_scale, layer))
    return merge_parts(parts)
