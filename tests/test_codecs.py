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


def test_round_bf16_matches_nextafter_on_edge_values():
    """reference.round_bf16 steps the f32 bit pattern (no jnp.nextafter, whose bf16
    lowering may differ between backends); it must give numpy's (ml_dtypes') bf16
    nextafter answer: zeros, exact bf16 values, both signs, the largest finite bf16,
    and random f32 over 60 decades. Not f32 subnormals: XLA:CPU flushes them to
    zero (with nextafter as well), and no key or value is ever that small."""
    import ml_dtypes

    from pallas_kernels.quant import reference as qr

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    edge = [0.0, -0.0, 1.0, -1.0, 1.0 + 2**-10, -(1.0 + 2**-10), 2.0**-126, -(2.0**-126),
            float(np.finfo(bf16).max), -float(np.finfo(bf16).max),
            float(np.finfo(bf16).max) * 0.999, 0.1, -0.1, 448.0, 15.0 / 7.0]
    x = np.concatenate([np.array(edge, np.float32),
                        (rng.standard_normal(4096) * 10.0 ** rng.uniform(-30, 30, 4096)
                         ).astype(np.float32)])
    b = x.astype(bf16)
    for up in (True, False):
        wrong = b.astype(np.float32) < x if up else b.astype(np.float32) > x
        want = np.where(wrong, np.nextafter(b, np.array(np.inf if up else -np.inf, bf16)), b)
        got = np.asarray(qr.round_bf16(jnp.asarray(x), up=up))
        np.testing.assert_array_equal(got.view(np.uint32),
                                      want.astype(np.float32).view(np.uint32))
