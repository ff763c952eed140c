"""Tier codecs (pure jnp): fp8 e4m3 for warm, int4 for cold. The one source of truth.

int4 packing is "half split": byte j of a row holds channel j in its low nibble
and channel j + D/2 in its high nibble, so unpacking yields two contiguous halves
(no interleave; kernels dot each half with the matching half of the query).
Codes are unsigned 0..15, asymmetric: x ~= lo + code * step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
INT4_LEVELS = 15.0
# Divisions by these constants are written as products with their reciprocals,
# here and in the kernels: XLA rewrites x / c into x * (1 / c) itself, and Triton
# does not, so a written division would differ between the two on a GPU.
INV_FP8_MAX = 1.0 / FP8_MAX
INV_INT4_LEVELS = 1.0 / INT4_LEVELS


def bf16_step(b: jax.Array, up: bool) -> jax.Array:
    """The next bf16 after b (f32 holding a bf16 value) toward +inf (up) or -inf, as
    f32: one step of the top 16 bits of its f32 pattern. No nextafter, whose bf16
    lowering is not the same on every backend; the Triton encoders run this too."""
    bits = jax.lax.bitcast_convert_type(b, jnp.int32)
    one = jnp.int32(0x10000)
    away = jnp.where(b > 0, up, not up)  # moving away from zero grows the magnitude
    stepped = jnp.where(away, bits + one, bits - one)
    # From zero: the smallest subnormal bf16 with the direction's sign.
    tiny = jnp.int32(0x00010000) if up else jnp.int32(-0x7FFF0000)  # 0x80010000
    stepped = jnp.where(b == 0, tiny, stepped)
    return jax.lax.bitcast_convert_type(stepped, jnp.float32)


def round_bf16(x: jax.Array, up: bool) -> jax.Array:
    """Smallest bf16 >= x (up) or largest bf16 <= x, as f32 holding it."""
    x = x.astype(jnp.float32)
    b = x.astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.where((b < x) if up else (b > x), bf16_step(b, up), b)


def round_bf16_down(x: jax.Array) -> jax.Array:
    """Largest bf16 <= x (so a stored lower bound stays a bound)."""
    return round_bf16(x, up=False).astype(jnp.bfloat16)


def round_bf16_up(x: jax.Array) -> jax.Array:
    """Smallest bf16 >= x."""
    return round_bf16(x, up=True).astype(jnp.bfloat16)


def round_fp8_up(x: jax.Array) -> jax.Array:
    """Smallest e4m3 value >= x for x >= 0, as f32 (saturating at FP8_MAX; NaN stays
    NaN). Plain f32 arithmetic on the exponent bits so the Triton encoder runs this
    same function: the e4m3 step at x is 2**(max(exponent, -6) - 3)."""
    x = x.astype(jnp.float32)
    biased = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xFF
    biased = jnp.maximum(biased, 127 - 6)  # e4m3 subnormals share the 2**-6 binade step
    step = jax.lax.bitcast_convert_type((biased - 3) << 23, jnp.float32)
    inv_step = jax.lax.bitcast_convert_type((257 - biased) << 23, jnp.float32)
    up = -jnp.floor(-(x * inv_step)) * step  # exact: scaling by powers of two
    return jnp.where(up > FP8_MAX, FP8_MAX, up)


def pack_int4(codes: jax.Array) -> jax.Array:
    """[..., D] ints in 0..15 -> [..., D/2] uint8 (half split)."""
    half = codes.shape[-1] // 2
    c = codes.astype(jnp.uint8)
    return c[..., :half] | (c[..., half:] << 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """[..., D/2] uint8 -> [..., D] float32 codes in 0..15."""
    lo = (packed & 0xF).astype(jnp.float32)
    hi = (packed >> 4).astype(jnp.float32)
    return jnp.concatenate([lo, hi], axis=-1)


def _quantize(x, lo, step):
    """Codes of x on the grid lo + step * {0..15}; a zero step (constant data) gives 0,
    and so does NaN (a uint8 cast of NaN is undefined; the page's NaN range still
    poisons its own sequence, and only it)."""
    safe = jnp.where(step > 0, step, 1.0)
    codes = jnp.where(step > 0, jnp.round((x - lo) / safe), 0.0)
    return jnp.clip(jnp.where(jnp.isnan(codes), 0.0, codes), 0.0, INT4_LEVELS)


def encode_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (e4m3 codes [..., D], f32 scale [...]); one scale per row (token, head)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax * INV_FP8_MAX, 1.0)
    return (x / scale[..., None]).astype(FP8_DTYPE), scale


def decode_fp8(codes: jax.Array, scale: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32) * scale[..., None]


def encode_cold_keys(k: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys of whole pages [..., page, D] -> (packed [..., page, D/2] uint8,
    center [..., D] bf16, radius [..., D] e4m3).

    The digest is the page's per-channel key range [min, max], stored as a bf16
    centre and an e4m3 radius rounded up, so [c - r, c + r] still holds every key
    (3 bytes per channel: what lets the offloaded cache keep 16x; the round-up
    widens a range by 4% on average, 12.5% at most). It is both the Quest bound's
    input and the int4 grid: per-channel asymmetric codes on c - r + code * 2r/15.
    A channel whose range within one page exceeds 2 * 448 saturates (its extreme
    keys clip to the grid's ends); keys of real models are two orders smaller.
    """
    k = k.astype(jnp.float32)
    kmin, kmax = jnp.min(k, axis=-2), jnp.max(k, axis=-2)
    center = ((kmin + kmax) * 0.5).astype(jnp.bfloat16)
    c = center.astype(jnp.float32)
    radius = round_fp8_up(jnp.maximum(c - kmin, kmax - c))
    # A NaN key makes its channel's range NaN (reductions differ on NaN between
    # backends; this pins it): codes 0, and the sequence stays visibly poisoned.
    bad = jnp.any(jnp.isnan(k), axis=-2)
    center = jnp.where(bad, jnp.nan, center).astype(jnp.bfloat16)
    radius = jnp.where(bad, jnp.nan, radius).astype(FP8_DTYPE)
    # XLA:CPU would fuse the grid's math (an e4m3 rounding among it) into the loop
    # over every key, redoing it page-size x 2 times per channel (the fill's
    # costliest part at a long prompt): computed once, per channel
    lo, step = jax.lax.optimization_barrier(_key_grid(center, radius))
    return pack_int4(_quantize(k, lo, step)), center, radius


def _key_grid(center, radius):
    c = center.astype(jnp.float32)[..., None, :]
    r = radius.astype(jnp.float32)[..., None, :]
    return c - r, r * (2.0 / INT4_LEVELS)


def decode_cold_keys(packed, center, radius) -> jax.Array:
    lo, step = _key_grid(center, radius)
    return lo + unpack_int4(packed) * step


def encode_cold_values(v: jax.Array, group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Values [..., D] -> (packed [..., D/2] uint8, scale [..., D/group] bf16,
    zero [..., D/group] bf16): per token, groups of `group` consecutive channels."""
    v = v.astype(jnp.float32)
    d = v.shape[-1]
    g = v.reshape(*v.shape[:-1], d // group, group)
    bad = jnp.any(jnp.isnan(g), axis=-1)  # as for keys: a NaN group has NaN scale/zero
    zero = jnp.where(bad, jnp.nan, round_bf16_down(jnp.min(g, axis=-1))).astype(jnp.bfloat16)
    step = round_bf16_up((jnp.max(g, axis=-1) - zero.astype(jnp.float32)) * INV_INT4_LEVELS)
    step = jnp.where(bad, jnp.nan, step).astype(jnp.bfloat16)
    zero, step = jax.lax.optimization_barrier((zero, step))  # once per group, as for keys
    codes = _quantize(g, zero.astype(jnp.float32)[..., None], step.astype(jnp.float32)[..., None])
    return pack_int4(codes.reshape(v.shape)), step, zero


def decode_cold_values(packed, scale, zero) -> jax.Array:
    codes = unpack_int4(packed)
    d = codes.shape[-1]
    ngroups = scale.shape[-1]
    g = codes.reshape(*codes.shape[:-1], ngroups, d // ngroups)
    out = zero.astype(jnp.float32)[..., None] + g * scale.astype(jnp.float32)[..., None]
    return out.reshape(codes.shape)
