"""Tier encoders as Pallas (Triton backend) kernels, bit for bit equal to
`reference.encode_fp8`, `reference.encode_cold_keys`, `reference.encode_cold_values`.

Bit-exactness needs care with ops whose lowering differs between backends:
- f32 division by data is plain `/` on both sides. XLA lowers it to
  `div.full.f32` on NVIDIA (it sets `-nvptx-prec-divf32=1`), as Triton does
  `arith.divf`, and to IEEE division on a CPU. Division by a constant is a
  product with its reciprocal on both sides (`reference.INV_FP8_MAX`), which
  is what XLA makes of `x / c` anyway. The first H200 run (2026-12-04) had the kernels on
  IEEE `div.rn.f32` (inline PTX), and their fp8 scales were one ulp off XLA's
  in 48% of rows.
- `round` (half to even) has no Triton lowering: written out with floor.
- bf16 "round down/up" (`reference.round_bf16`) steps the f32 bit pattern (bf16
  = its top 16 bits) in the reference and here alike, with no `nextafter`.
int4 packing is half split: byte j = channel j (low nibble) | channel j+D/2 << 4.
Value slices are not allowed in Triton kernels, so the two halves are read from
the ref separately.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import is_pow2, pow2_floor, resolve_interpret
from pallas_kernels.quant.reference import (
    FP8_DTYPE,
    INT4_LEVELS,
    INV_FP8_MAX,
    INV_INT4_LEVELS,
    round_bf16,
    round_fp8_up,
)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """block_rows: rows (tokens) per program for the row-wise encoders (power of two)."""
    block_rows: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if not is_pow2(self.block_rows):
            raise ValueError(f"block_rows must be a power of two, got {self.block_rows}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")


def _params(cfg):
    return pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------- helpers


def _round_half_even(x):
    """jnp.round (ties to even) for |x| < 2**22, without lax.round."""
    f = jnp.floor(x)
    d = x - f
    odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0.0
    return jnp.where(d > 0.5, f + 1.0, jnp.where(d < 0.5, f, jnp.where(odd, f + 1.0, f)))


def _quantize(x, lo, step):
    safe = jnp.where(step > 0, step, 1.0)
    codes = jnp.where(step > 0, _round_half_even((x - lo) / safe), 0.0)
    return jnp.clip(jnp.where(jnp.isnan(codes), 0.0, codes), 0.0, INT4_LEVELS)  # as reference


def _any_nan(x, axis):
    """Whether x holds a NaN along axis (a max of 0/1: reductions of NaN itself
    differ between backends)."""
    return jnp.max(jnp.where(jnp.isnan(x), 1.0, 0.0), axis=axis) > 0


def _pack(c_lo, c_hi):
    return c_lo.astype(jnp.uint8) | (c_hi.astype(jnp.uint8) << 4)


def _rows_pad(x2, br):
    r = x2.shape[0]
    r_pad = -(-r // br) * br
    if r_pad != r:
        x2 = jnp.pad(x2, ((0, r_pad - r), (0, 0)))
    return x2, r_pad


# ----------------------------------------------------------------------------- fp8


def _fp8_kernel(x_ref, codes_ref, scale_ref):
    # x_ref: [BR, D] any float; codes_ref: [BR, D] e4m3; scale_ref: [BR] f32
    x = x_ref[...].astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1)
    scale = jnp.where(amax > 0, amax * INV_FP8_MAX, 1.0)
    codes_ref[...] = (x / scale[:, None]).astype(FP8_DTYPE)
    scale_ref[...] = scale


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def encode_fp8(x: jax.Array, *, interpret=None, config: QuantConfig | None = None):
    """[..., D] -> (e4m3 codes [..., D], f32 scale [...]); see reference.encode_fp8."""
    interpret = resolve_interpret(interpret)
    cfg = config or QuantConfig()
    *lead, d = x.shape
    if not is_pow2(d):
        raise ValueError(f"last dim must be a power of two, got {d}")
    r = 1
    for s in lead:
        r *= s
    if r == 0:
        return jnp.zeros(x.shape, FP8_DTYPE), jnp.zeros(tuple(lead), jnp.float32)
    br = cfg.block_rows if r >= cfg.block_rows else pow2_floor(r)
    x2, r_pad = _rows_pad(x.reshape(r, d), br)
    codes, scale = pl.pallas_call(
        _fp8_kernel,
        grid=(r_pad // br,),
        in_specs=[pl.BlockSpec((br, d), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((br,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((r_pad, d), FP8_DTYPE),
                   jax.ShapeDtypeStruct((r_pad,), jnp.float32)],
        interpret=interpret, compiler_params=_params(cfg), name="hisparse_encode_fp8",
    )(x2)
    return codes[:r].reshape(x.shape), scale[:r].reshape(tuple(lead))


# ----------------------------------------------------------------------------- cold keys


def _cold_keys_kernel(k_ref, packed_ref, center_ref, radius_ref, *, half):
    # k_ref: [page, D] any float (one page); packed_ref: [page, D/2] u8;
    # center_ref: [D] bf16; radius_ref: [D] e4m3
    codes = []
    for j in range(2):  # low half (channels 0..D/2-1), high half (D/2..D-1)
        k = k_ref[:, pl.ds(j * half, half)].astype(jnp.float32)      # [page, D/2]
        kmin, kmax = jnp.min(k, axis=0), jnp.max(k, axis=0)           # [D/2]
        c = ((kmin + kmax) * 0.5).astype(jnp.bfloat16).astype(jnp.float32)
        r = round_fp8_up(jnp.maximum(c - kmin, kmax - c))
        bad = _any_nan(k, axis=0)  # as the reference: NaN range, codes 0
        c, r = jnp.where(bad, jnp.nan, c), jnp.where(bad, jnp.nan, r)
        lo, step = c - r, r * (2.0 / INT4_LEVELS)
        codes.append(_quantize(k, lo[None, :], step[None, :]))
        center_ref[pl.ds(j * half, half)] = c.astype(jnp.bfloat16)
        radius_ref[pl.ds(j * half, half)] = r.astype(FP8_DTYPE)
    packed_ref[...] = _pack(codes[0], codes[1])


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def encode_cold_keys(k: jax.Array, *, interpret=None, config: QuantConfig | None = None):
    """Keys of whole pages [..., page, D] -> (packed [..., page, D/2] u8,
    center [..., D] bf16, radius [..., D] e4m3); see reference.encode_cold_keys.
    page and D must be powers of two. One page per program."""
    interpret = resolve_interpret(interpret)
    cfg = config or QuantConfig()
    *lead, page, d = k.shape
    if not (is_pow2(d) and d >= 2 and is_pow2(page)):
        raise ValueError(f"page and head_dim must be powers of two, got {page}, {d}")
    n = 1
    for s in lead:
        n *= s
    half = d // 2
    packed, center, radius = pl.pallas_call(
        functools.partial(_cold_keys_kernel, half=half),
        grid=(n,),
        in_specs=[pl.BlockSpec((None, page, d), lambda i: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, page, half), lambda i: (i, 0, 0)),
                   pl.BlockSpec((None, d), lambda i: (i, 0)),
                   pl.BlockSpec((None, d), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, page, half), jnp.uint8),
                   jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
                   jax.ShapeDtypeStruct((n, d), FP8_DTYPE)],
        interpret=interpret, compiler_params=_params(cfg), name="hisparse_encode_cold_keys",
    )(k.reshape(n, page, d))
    lead = tuple(lead)
    return (packed.reshape(*lead, page, half), center.reshape(*lead, d),
            radius.reshape(*lead, d))


# ----------------------------------------------------------------------------- cold values


def _cold_values_kernel(v_ref, packed_ref, scale_ref, zero_ref, *, half, group):
    # v_ref: [BR, D] any float; packed_ref: [BR, D/2] u8; scale_ref, zero_ref: [BR, D/group] bf16
    if group <= half:
        # Group j of the low half pairs with group j + D/(2 group) of the high half.
        ng_half = half // group
        for j in range(ng_half):
            codes = []
            for part in range(2):
                col = part * half + j * group
                x = v_ref[:, pl.ds(col, group)].astype(jnp.float32)      # [BR, group]
                bad = _any_nan(x, axis=1)
                zero = jnp.where(bad, jnp.nan, round_bf16(jnp.min(x, axis=1), up=False))
                step = round_bf16((jnp.max(x, axis=1) - zero) * INV_INT4_LEVELS, up=True)
                step = jnp.where(bad, jnp.nan, step)
                codes.append(_quantize(x, zero[:, None], step[:, None]))
                gi = part * ng_half + j
                scale_ref[:, pl.ds(gi, 1)] = step.astype(jnp.bfloat16)[:, None]
                zero_ref[:, pl.ds(gi, 1)] = zero.astype(jnp.bfloat16)[:, None]
            packed_ref[:, pl.ds(j * group, group)] = _pack(codes[0], codes[1])
    else:  # one group spans both halves (group == D)
        xl = v_ref[:, pl.ds(0, half)].astype(jnp.float32)
        xh = v_ref[:, pl.ds(half, half)].astype(jnp.float32)
        bad = _any_nan(xl, axis=1) | _any_nan(xh, axis=1)
        zero = round_bf16(jnp.minimum(jnp.min(xl, axis=1), jnp.min(xh, axis=1)), up=False)
        zero = jnp.where(bad, jnp.nan, zero)
        mx = jnp.maximum(jnp.max(xl, axis=1), jnp.max(xh, axis=1))
        step = jnp.where(bad, jnp.nan, round_bf16((mx - zero) * INV_INT4_LEVELS,
                                                  up=True))
        cl = _quantize(xl, zero[:, None], step[:, None])
        ch = _quantize(xh, zero[:, None], step[:, None])
        packed_ref[...] = _pack(cl, ch)
        scale_ref[...] = step.astype(jnp.bfloat16)[:, None]
        zero_ref[...] = zero.astype(jnp.bfloat16)[:, None]


@functools.partial(jax.jit, static_argnames=("group", "interpret", "config"))
def encode_cold_values(v: jax.Array, group: int, *, interpret=None,
                       config: QuantConfig | None = None):
    """Values [..., D] -> (packed [..., D/2] u8, scale [..., D/group] bf16,
    zero [..., D/group] bf16); see reference.encode_cold_values.
    D and group powers of two, group <= D/2 or group == D."""
    interpret = resolve_interpret(interpret)
    cfg = config or QuantConfig()
    *lead, d = v.shape
    half = d // 2
    if not (is_pow2(d) and d >= 2 and is_pow2(group) and (group <= half or group == d)):
        raise ValueError(f"unsupported head_dim {d} / group {group}")
    ng = d // group
    r = 1
    for s in lead:
        r *= s
    lead = tuple(lead)
    if r == 0:
        return (jnp.zeros((*lead, half), jnp.uint8), jnp.zeros((*lead, ng), jnp.bfloat16),
                jnp.zeros((*lead, ng), jnp.bfloat16))
    br = cfg.block_rows if r >= cfg.block_rows else pow2_floor(r)
    v2, r_pad = _rows_pad(v.reshape(r, d), br)
    packed, scale, zero = pl.pallas_call(
        functools.partial(_cold_values_kernel, half=half, group=group),
        grid=(r_pad // br,),
        in_specs=[pl.BlockSpec((br, d), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((br, half), lambda i: (i, 0)),
                   pl.BlockSpec((br, ng), lambda i: (i, 0)),
                   pl.BlockSpec((br, ng), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((r_pad, half), jnp.uint8),
                   jax.ShapeDtypeStruct((r_pad, ng), jnp.bfloat16),
                   jax.ShapeDtypeStruct((r_pad, ng), jnp.bfloat16)],
        interpret=interpret, compiler_params=_params(cfg), name="hisparse_encode_cold_values",
    )(v2)
    return (packed[:r].reshape(*lead, half), scale[:r].reshape(*lead, ng),
            zero[:r].reshape(*lead, ng))
