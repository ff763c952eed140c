"""Sparse decode attention as Pallas (Triton backend) kernels: split-K
flash-decoding over the attended set. Same signature and results as
`reference.sparse_decode`.

Three pallas_calls, one per part, each on a grid (batch, kv head, split):
- bf16 part (sink + hot ring): K/V rows read as is;
- fp8 part (warm ring): e4m3 codes; the per-token K scale multiplies the logits
  and the per-token V scale the probabilities (no dequantized tile is built);
- int4 cold part: the selected pool pages, gathered by `cold_ids`; nibbles are
  unpacked in registers into the two half-split halves, keys dequantized as
  lo + code * step (lo = c - r, step = 2r/15 from the page digest centre c and
  radius r), values as zero + code * scale per channel group, and each half is
  dotted with the matching half of q. Each page's log weight (`cold_logw`: 0 for
  a selected page, log(importance weight) for a sampled one) is added to its
  logits.
Every split keeps an online softmax and emits (out, lse); splits and parts are
merged by log-sum-exp in XLA (`reference.merge_parts`).

Pools are passed whole with `memory_space=pl.ANY` and read by row gathers
(`ref[rows, :]`), so nothing is padded or copied in the wrapper except the tiny
index arrays: out-of-range token positions are clamped to a real row and masked.
Masked slots and cold_ids == -1 may hold NaN in memory: they are zeroed with
`where` before every dot and their logits set to -inf, never multiplied by 0.

The query group is padded to >= 16 rows (tl.dot needs M >= 16) with zero rows
that are dropped at the end. Tile dims (block_tokens, D/2, padded group) are
powers of two. Pool offsets are computed in int32: a pool must hold fewer than
2**31 elements.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import is_pow2, pow2_ceil, resolve_interpret
from pallas_kernels.quant.reference import INT4_LEVELS
from pallas_kernels.sparse_decode.reference import merge_parts

# Programs wanted per part: 2-4 waves of the H200's 132 SMs.
_TARGET_PROGRAMS = 4 * 132

_PRECISIONS = {
    # Three bf16 tensor-core dots (hi*hi + hi*lo + lo*hi): ~f32 accuracy.
    "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    # IEEE f32 (FMA on the GPU): exact, slower.
    "f32": lax.Precision.HIGHEST,
    # One bf16 dot: fastest, ~3 significant digits in q.
    "bf16": lax.DotAlgorithmPreset.BF16_BF16_F32,
}








@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of the sparse decode kernels (validated when built).

    block_tokens: tokens per inner step of a split (power of two, >= 16).
    num_splits:   splits per (batch, kv head) and part; None = enough programs for
                  ~4 waves of 132 SMs, at most one split per block of tokens.
    num_warps, num_stages: Triton launch parameters.
    precision:    dot precision, one of "bf16x3" (default), "f32", "bf16".
    """
    block_tokens: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    precision: str = "bf16x3"

    def __post_init__(self):
        if not (is_pow2(self.block_tokens) and self.block_tokens >= 16):
            raise ValueError(f"block_tokens must be a power of two >= 16, got {self.block_tokens}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(_PRECISIONS)}, got {self.precision}")

    def splits(self, batch: int, kv_heads: int, num_blocks: int) -> int:
        want = self.num_splits or -(-_TARGET_PROGRAMS // max(batch * kv_heads, 1))
        return max(1, min(want, num_blocks))


# ----------------------------------------------------------------------------- kernels


def _dot_nt(a, b, prec):  # [M, K] x [N, K] -> [M, N] f32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _dot_nn(a, b, prec):  # [M, K] x [K, N] -> [M, N] f32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _online_step(carry, s, valid):
    """One online-softmax step. s [Gp, BT] logits (finite), valid [BT].
    Returns (m_new, alpha [Gp], p [Gp, BT], l_new)."""
    m, l = carry
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_use)
    p = jnp.exp(s - m_use[:, None])
    l_new = l * alpha + jnp.sum(p, axis=1)
    return m_new, alpha, p, l_new


def _finish(m, l):
    ok = l > 0
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(ok, m_safe + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
    return jnp.where(ok, l, 1.0), lse


def _dense_kernel(q_ref, valid_ref, k_ref, v_ref, *rest, seq, kv_heads, block, num_blocks,
                  scaled, sm_scale, prec):
    # q_ref:     [Gp, D] f32              this (b, h), zero rows past G
    # valid_ref: [B * T] int32 (ANY)      slot validity, row b*T + t
    # k_ref:     [B * Hkv * T, D] bf16 | e4m3 (ANY), row (b*Hkv + h)*T + t
    # v_ref:     [B * Hkv * T, D] (ANY)
    # ks_ref, vs_ref (scaled only): [B * Hkv * T] f32 (ANY)
    # o_ref:     [Gp, D] f32;  lse_ref: [Gp] f32   (this split)
    if scaled:
        ks_ref, vs_ref, o_ref, lse_ref = rest
    else:
        o_ref, lse_ref = rest
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = q_ref[...]
    gp, d = q.shape
    base = (b * kv_heads + h) * seq
    t0 = s * (num_blocks * block)

    def body(i, carry):
        m, l, acc = carry
        t = t0 + i * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
        tc = jnp.minimum(t, seq - 1)
        valid = (t < seq) & (valid_ref[b * seq + tc] != 0)          # [BT]
        rows = base + tc
        k = jnp.where(valid[:, None], k_ref[rows, :].astype(jnp.float32), 0.0)  # [BT, D]
        logits = _dot_nt(q, k, prec)                                 # [Gp, BT]
        if scaled:
            logits = logits * jnp.where(valid, ks_ref[rows], 0.0)[None, :]
        m_new, alpha, p, l_new = _online_step((m, l), logits * sm_scale, valid)
        v = jnp.where(valid[:, None], v_ref[rows, :].astype(jnp.float32), 0.0)  # [BT, D]
        if scaled:
            p = p * jnp.where(valid, vs_ref[rows], 0.0)[None, :]
        acc = acc * alpha[:, None] + _dot_nn(p, v, prec)
        return m_new, l_new, acc

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, d), jnp.float32))
    m, l, acc = lax.fori_loop(0, num_blocks, body, init)
    denom, lse = _finish(m, l)
    o_ref[...] = acc / denom[:, None]
    lse_ref[...] = lse


def _cold_kernel(q_ref, ids_ref, lw_ref, k_ref, v_ref, vs_ref, vz_ref, c_ref, r_ref, o_ref,
                 lse_ref, *, page, pool_pages, head_dim, group, block, num_blocks, sm_scale,
                 prec):
    # q_ref:    [Gp, D] f32                  this (b, h)
    # ids_ref:  [Kp] int32                   selected pool pages of (b, h), -1 = none
    # lw_ref:   [Kp] f32                     log weight of each page (0 = selected)
    # k_ref, v_ref: [Hkv * P * page, D/2] u8 (ANY), row (h*P + id)*page + tok, half split
    # vs_ref, vz_ref: [Hkv * P * page * D/group] bf16 (ANY), value scale / zero per group
    # c_ref, r_ref: [Hkv * P * D] bf16 / e4m3 (ANY), key range centre / radius per page, channel
    # o_ref: [Gp, D] f32;  lse_ref: [Gp] f32  (this split)
    # A block is `pb` whole pages (block >= page): per-page quantities (ids, key
    # range) are loaded once per page and broadcast over its tokens by reshapes;
    # value scales/zeros once per (token, group) and broadcast over the group.
    _b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    half = head_dim // 2
    ngroups = head_dim // group
    gh = half // group if group <= half else 1               # groups per half
    pb = block // page
    log_page = page.bit_length() - 1
    q_lo = q_ref[:, pl.ds(0, half)]                                  # [Gp, D/2]
    q_hi = q_ref[:, pl.ds(half, half)]
    gp = q_lo.shape[0]
    slot0 = s * (num_blocks * pb)                                    # first page slot
    chan = lax.broadcasted_iota(jnp.int32, (1, half), 1)             # [1, D/2]
    tok = lax.broadcasted_iota(jnp.int32, (1, page), 1)              # [1, page]
    gidx = lax.broadcasted_iota(jnp.int32, (1, gh), 1)               # [1, gh]

    def per_token(x):  # [PB, ...] -> [BT, ...]: repeat each page's row over its tokens
        x = jnp.broadcast_to(x[:, None], (pb, page) + x.shape[1:])
        return x.reshape((block,) + x.shape[2:])

    def dequant_half(codes, lo, step):  # codes [BT, D/2] u8-derived; lo/step [PB, D/2]
        c3 = codes.astype(jnp.float32).reshape(pb, page, half)
        return (lo[:, None, :] + c3 * step[:, None, :]).reshape(block, half)

    def values_half(codes, g_first, rows):  # codes [BT, D/2]; groups g_first.. of the half
        c = codes.astype(jnp.float32)
        if group <= half:
            idx = rows[:, None] * ngroups + (g_first + gidx)          # [BT, gh]
            sc = vs_ref[idx].astype(jnp.float32)
            zr = vz_ref[idx].astype(jnp.float32)
            c3 = c.reshape(block, gh, group)
            return (zr[:, :, None] + c3 * sc[:, :, None]).reshape(block, half)
        sc = vs_ref[rows].astype(jnp.float32)                        # one group: [BT]
        zr = vz_ref[rows].astype(jnp.float32)
        return zr[:, None] + c * sc[:, None]

    def body(i, carry):
        m, l, acc_lo, acc_hi = carry
        ids = ids_ref[pl.ds(slot0 + i * pb, pb)]                     # [PB]
        lw = lw_ref[pl.ds(slot0 + i * pb, pb)]                       # masked with `valid`
        prow = h * pool_pages + jnp.maximum(ids, 0)                  # pool row of each page
        rows = ((prow[:, None] << log_page) + tok).reshape(block)    # [BT]
        valid = per_token(ids >= 0)                                  # [BT]
        keep = valid[:, None]

        # Key grid lo + code * step, lo = c - r, step = 2r / 15 (reference.quant).
        col = prow[:, None] * head_dim + chan                        # [PB, D/2], low half
        c_l = c_ref[col].astype(jnp.float32)
        c_h = c_ref[col + half].astype(jnp.float32)
        r_l = r_ref[col].astype(jnp.float32)
        r_h = r_ref[col + half].astype(jnp.float32)
        ku = k_ref[rows, :]                                          # [BT, D/2] u8
        k_l = jnp.where(keep, dequant_half(ku & 0xF, c_l - r_l, r_l * (2.0 / INT4_LEVELS)), 0.0)
        k_h = jnp.where(keep, dequant_half(ku >> 4, c_h - r_h, r_h * (2.0 / INT4_LEVELS)), 0.0)
        logits = _dot_nt(q_lo, k_l, prec) + _dot_nt(q_hi, k_h, prec)  # [Gp, BT]
        logits = logits * sm_scale + per_token(lw)[None, :]
        m_new, alpha, p, l_new = _online_step((m, l), logits, valid)

        vu = v_ref[rows, :]                                          # [BT, D/2] u8
        v_l = jnp.where(keep, values_half(vu & 0xF, 0, rows), 0.0)
        v_h = jnp.where(keep, values_half(vu >> 4, gh, rows), 0.0)
        acc_lo = acc_lo * alpha[:, None] + _dot_nn(p, v_l, prec)
        acc_hi = acc_hi * alpha[:, None] + _dot_nn(p, v_h, prec)
        return m_new, l_new, acc_lo, acc_hi

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, half), jnp.float32), jnp.zeros((gp, half), jnp.float32))
    m, l, acc_lo, acc_hi = lax.fori_loop(0, num_blocks, body, init)
    denom, lse = _finish(m, l)
    o_ref[:, pl.ds(0, half)] = acc_lo / denom[:, None]
    o_ref[:, pl.ds(half, half)] = acc_hi / denom[:, None]
    lse_ref[...] = lse


# ----------------------------------------------------------------------------- wrappers


def _merge_splits(o, lse):
    """o [B, Hkv, S, Gp, D], lse [B, Hkv, S, Gp] -> (o [B, Hkv, Gp, D], lse [B, Hkv, Gp])."""
    m = jnp.max(lse, axis=2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe[:, :, None])
    total = jnp.sum(w, axis=2)
    out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return out, lse


def _call(kernel, grid, qp, operands, any_mask, gp, d, cfg, interpret, name, lead_spec):
    b, hkv, splits = grid
    in_specs = [pl.BlockSpec((None, None, gp, d), lambda i, j, k: (i, j, 0, 0))]
    for is_any, spec in zip(any_mask, lead_spec):
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY) if is_any else spec)
    o, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, j, k: (i, j, k, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, j, k: (i, j, k, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32)],
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name=name,
    )(qp, *operands)
    return _merge_splits(o, lse)


def _dense_part(qp, k, v, valid, k_scale, v_scale, *, sm_scale, cfg, interpret, name):
    b, hkv, gp, d = qp.shape
    t = k.shape[2]
    blk = cfg.block_tokens
    total_blocks = -(-t // blk)
    splits = cfg.splits(b, hkv, total_blocks)
    nblk = -(-total_blocks // splits)
    splits = -(-total_blocks // nblk)  # drop splits that would be empty
    scaled = k_scale is not None
    kernel = functools.partial(_dense_kernel, seq=t, kv_heads=hkv, block=blk, num_blocks=nblk,
                               scaled=scaled, sm_scale=sm_scale,
                               prec=_PRECISIONS[cfg.precision])
    operands = [valid.astype(jnp.int32).reshape(-1), k.reshape(b * hkv * t, d),
                v.reshape(b * hkv * t, d)]
    if scaled:
        operands += [k_scale.astype(jnp.float32).reshape(-1),
                     v_scale.astype(jnp.float32).reshape(-1)]
    return _call(kernel, (b, hkv, splits), qp, operands, [True] * len(operands), gp, d, cfg,
                 interpret, name, [None] * len(operands))


def _cold_part(qp, cold_ids, cold_logw, int4_k, int4_v, v_scale, v_zero, digest_center,
               digest_radius, *, sm_scale, cfg, interpret):
    b, hkv, gp, d = qp.shape
    _, p, page, half = int4_k.shape
    ngroups = v_scale.shape[-1]
    group = d // ngroups
    if not (is_pow2(page) and is_pow2(group) and half * 2 == d):
        raise ValueError(f"page ({page}) and value group ({group}) must be powers of two")
    kk = cold_ids.shape[2]
    blk = max(cfg.block_tokens, page)  # whole pages per block
    total_blocks = -(-(kk * page) // blk)
    splits = cfg.splits(b, hkv, total_blocks)
    nblk = -(-total_blocks // splits)
    splits = -(-total_blocks // nblk)
    kp = -(-(splits * nblk * blk) // page)  # pages covered by the grid, padded with -1
    ids = cold_ids.astype(jnp.int32)
    logw = cold_logw.astype(jnp.float32)
    if kp != kk:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, kp - kk)), constant_values=-1)
        logw = jnp.pad(logw, ((0, 0), (0, 0), (0, kp - kk)))
    kernel = functools.partial(_cold_kernel, page=page, pool_pages=p, head_dim=d, group=group,
                               block=blk, num_blocks=nblk, sm_scale=sm_scale,
                               prec=_PRECISIONS[cfg.precision])
    operands = [ids, logw, int4_k.reshape(hkv * p * page, half),
                int4_v.reshape(hkv * p * page, half),
                v_scale.reshape(-1), v_zero.reshape(-1), digest_center.reshape(-1),
                digest_radius.reshape(-1)]
    ids_spec = pl.BlockSpec((None, None, kp), lambda i, j, k: (i, j, 0))
    return _call(kernel, (b, hkv, splits), qp, operands, [False, False] + [True] * 6, gp, d,
                 cfg, interpret, "hisparse_decode_int4", [ids_spec, ids_spec] + [None] * 6)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "config"))
def _sparse_decode(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
                   fp8_valid, int4_k, int4_v, int4_v_scale, int4_v_zero, digest_center,
                   digest_radius, cold_ids, cold_logw, *, sm_scale, interpret, config):
    b, hkv, g, d = q.shape
    if not (is_pow2(d) and d >= 32):
        raise ValueError(f"head_dim must be a power of two >= 32, got {d}")
    gp = max(16, pow2_ceil(g))
    qp = q.astype(jnp.float32)
    if gp != g:
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    kw = {"sm_scale": sm_scale, "cfg": config, "interpret": interpret}

    def trim(part):
        o, lse = part
        return o[:, :, :g], lse[:, :, :g]

    parts = []
    if bf16_k.shape[2]:
        parts.append(trim(_dense_part(qp, bf16_k, bf16_v, bf16_valid, None, None,
                                      name="hisparse_decode_bf16", **kw)))
    else:  # nothing to attend: the reference's empty part
        parts.append((jnp.zeros((b, hkv, g, d), jnp.float32),
                      jnp.full((b, hkv, g), -jnp.inf, jnp.float32)))
    if fp8_k.shape[2]:
        parts.append(trim(_dense_part(qp, fp8_k, fp8_v, fp8_valid, fp8_k_scale, fp8_v_scale,
                                      name="hisparse_decode_fp8", **kw)))
    if cold_ids.shape[2]:
        parts.append(trim(_cold_part(qp, cold_ids, cold_logw, int4_k, int4_v, int4_v_scale,
                                     int4_v_zero, digest_center, digest_radius, **kw)))
    return merge_parts(parts)


def sparse_decode(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
                  fp8_valid, int4_k, int4_v, int4_v_scale, int4_v_zero, digest_center,
                  digest_radius, cold_ids, *, sm_scale, cold_logw=None, interpret=None,
                  config: DecodeConfig | None = None):
    """Pallas version of `reference.sparse_decode` (same arguments, same results).

    q:            [B, Hkv, G, D] float32
    bf16_k/v:     [B, Hkv, Tb, D] bf16     sink slots, then the hot ring
    bf16_valid:   [B, Tb] bool
    fp8_k/v:      [B, Hkv, Tw, D] e4m3     warm ring
    fp8_*_scale:  [B, Hkv, Tw] f32         one scale per token per head
    fp8_valid:    [B, Tw] bool
    int4_k/v:     [Hkv, P, page, D/2] u8   cold pool, head-major (half-split packed)
    int4_v_scale, int4_v_zero: [Hkv, P, page, D/group] bf16
    digest_center, digest_radius: [Hkv, P, D] bf16, e4m3  key range of each page (int4 key grid)
    cold_ids:     [B, Hkv, K] int32        selected pool pages, -1 = none
    sm_scale:     Python float (static)
    cold_logw:    [B, Hkv, K] f32          log weight of each cold page, None = 0
    interpret:    None = interpret mode unless on GPU
    config:       DecodeConfig, None = DecodeConfig()
    returns (out [B, Hkv, G, D] f32, lse [B, Hkv, G] f32)
    """
    return _sparse_decode(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale,
                          fp8_v_scale, fp8_valid, int4_k, int4_v, int4_v_scale, int4_v_zero,
                          digest_center, digest_radius, cold_ids,
                          jnp.zeros(cold_ids.shape, jnp.float32) if cold_logw is None
                          else cold_logw, sm_scale=float(sm_scale),
                          interpret=resolve_interpret(interpret),
                          config=config or DecodeConfig())
