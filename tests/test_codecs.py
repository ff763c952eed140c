import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant import (
    decode_cold_keys,
    decode_cold_values,
    decode_fp8,
    encode_cold_keys,
    encode_cold_values,
    encode_fp8,
    pack_int4,
    unpack_int4,
)
from pallas_kernels.quant.reference import round_fp8_up


def test_round_fp8_up_is_the_smallest_e4m3_not_below():
    """Every e4m3 value, its neighbours in f32, and random magnitudes over the whole
    range: the result is an e4m3 value >= x with no e4m3 value in between."""
    e4m3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)
    e4m3 = np.unique(e4m3[np.isfinite(e4m3) & (e4m3 >= 0)])
    rng = np.random.default_rng(0)
    x = np.concatenate([e4m3, e4m3 * (1 + 1e-6), e4m3 * (1 - 1e-6), [1e-30, 2.0**-10],
                        np.exp(rng.uniform(-15, 6, 4000))]).astype(np.float32)
    x = x[x <= 448]
    y = np.asarray(round_fp8_up(jnp.asarray(x)))
    assert np.isin(y, e4m3).all() and (y >= x).all()
    below = e4m3[np.maximum(np.searchsorted(e4m3, y) - 1, 0)]  # next e4m3 under y
    assert ((below < x) | (y == 0)).all()
    big = np.asarray(round_fp8_up(jnp.asarray([449.0, 1e9, np.nan], jnp.float32)))
    assert big[0] == big[1] == 448 and np.isnan(big[2])


def test_pack_roundtrip():
    codes = np.random.default_rng(0).integers(0, 16, size=(5, 64))
    assert np.array_equal(np.asarray(unpack_int4(pack_int4(jnp.asarray(codes)))), codes)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_key_digest_bounds_dequantized_keys(d):
    rng = np.random.default_rng(d)
    k = (rng.normal(size=(7, 3, 16, d)) * rng.uniform(0.1, 20, size=d)).astype(np.float32)
    packed, c, r = encode_cold_keys(jnp.asarray(k))
    kd = np.asarray(decode_cold_keys(packed, c, r))
    c, r = np.asarray(c, np.float32), np.asarray(r, np.float32)
    lo, hi = c - r, c + r
    assert np.all(lo[..., None, :] <= k) and np.all(k <= hi[..., None, :])
    ulp = 1e-6 * np.maximum(np.abs(lo), np.abs(hi))[..., None, :]  # f32 rounding of lo + 15*step
    assert np.all(lo[..., None, :] <= kd + ulp) and np.all(kd <= hi[..., None, :] + ulp)
    step = 2 * r / 15
    assert np.all(np.abs(kd - k) <= step[..., None, :] * 0.5 + 2 * ulp)


def test_constant_pages_quantize_exactly():
    k = np.full((2, 16, 64), 3.0, np.float32)
    packed, lo, hi = encode_cold_keys(jnp.asarray(k))
    assert np.all(np.isfinite(np.asarray(decode_cold_keys(packed, lo, hi))))
    assert np.allclose(np.asarray(decode_cold_keys(packed, lo, hi)), 3.0)
    v = np.zeros((4, 64), np.float32)
    assert np.allclose(np.asarray(decode_cold_values(*encode_cold_values(jnp.asarray(v), 32))), 0)
    codes, scale = encode_fp8(jnp.zeros((3, 64)))
    assert np.all(np.asarray(decode_fp8(codes, scale)) == 0)


@pytest.mark.parametrize("group,bound", [(32, 0.12), (16, 0.10)])
def test_value_error_bounded_by_group_step(group, bound):
    v = np.random.default_rng(1).normal(size=(512, 128)).astype(np.float32)
    vd = np.asarray(decode_cold_values(*encode_cold_values(jnp.asarray(v), group)))
    rel = np.linalg.norm(vd - v, axis=-1) / np.linalg.norm(v, axis=-1)
    assert rel.mean() < bound


def test_fp8_relative_error():
    x = np.random.default_rng(2).normal(size=(256, 128)).astype(np.float32)
    xd = np.asarray(decode_fp8(*encode_fp8(jnp.asarray(x))))
    assert np.max(np.abs(xd - x) / np.max(np.abs(x), -1, keepdims=True)) <= 2 ** -4
