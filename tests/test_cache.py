"""The cache: exact against an independent dequantized reference, tiers, errors, isolation."""

import numpy as np
import pytest

from hisparse_jax.cache.handle import CacheFullError, HiSparseCache
from hisparse_jax.cache.layout import nbytes, state_bytes
from hisparse_jax.cache.state import init_state, slot_positions
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig
from tests.helpers import dense, dequantized_kv

SMALL = {"num_kv_heads": 2, "head_dim": 64, "max_context": 2048, "max_seqs": 2,
         "budget_tokens": FULL_BUDGET}


def _kv(rng, s, cfg):
    shape = (s, cfg.num_kv_heads, cfg.head_dim)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("page,gqa,length", [
    (16, 1, 1), (16, 4, 37), (16, 4, 700), (32, 8, 1001), (64, 2, 2048), (16, 2, 528),
])
def test_full_budget_equals_dequantized_reference(page, gqa, length, implementation):
    cfg = HiSparseConfig(page_size=page, gqa_group=gqa, sink_tokens=16, **SMALL)
    rng = np.random.default_rng(length)
    k, v = _kv(rng, length, cfg)
    cache = HiSparseCache(cfg, implementation)
    cache.prefill(1, k, v)
    q = rng.normal(size=(2, cfg.num_q_heads, cfg.head_dim)).astype(np.float32)
    out = np.asarray(cache.attend(q))
    kh, vh, _ = dequantized_kv(cfg, k, v)
    np.testing.assert_allclose(out[1], dense(q[1], kh, vh), rtol=2e-4, atol=2e-5)
    assert np.all(out[0] == 0)  # empty sequence


@pytest.mark.parametrize("page,warm", [(16, 384), (16, 0), (32, 64)])
def test_decode_appends_match_prefill(page, warm, implementation):
    """Token-by-token appends reach the same tiers as one prefill; cold pages made by
    re-encoding fp8 are close to those encoded from the source."""
    cfg = HiSparseConfig(page_size=page, warm_tokens=warm, gqa_group=2, **SMALL)
    rng = np.random.default_rng(page + warm)
    n0, n = 300, 1200
    k, v = _kv(rng, n, cfg)
    a, b = HiSparseCache(cfg, implementation), HiSparseCache(cfg, implementation)
    a.prefill(0, k, v)
    b.prefill(0, k[:n0], v[:n0])
    for t in range(n0, n):
        kk = np.stack([k[t], np.full_like(k[t], np.nan)])  # seq 1 inactive, NaN junk
        b.append(kk, np.stack([v[t], v[t]]), active=[True, False])
    assert np.array_equal(np.asarray(a.state.page_table), np.asarray(b.state.page_table))
    assert int(a.state.num_free) == int(b.state.num_free) == a.num_free == b.num_free
    live = np.asarray(slot_positions(cfg, a.state.seq_lens)[0][0]) >= 0  # stale slots may differ
    np.testing.assert_array_equal(np.asarray(a.state.bf16_k)[0][:, live],
                                  np.asarray(b.state.bf16_k)[0][:, live])
    q = rng.normal(size=(2, cfg.num_q_heads, cfg.head_dim)).astype(np.float32)
    oa, ob = np.asarray(a.attend(q))[0], np.asarray(b.attend(q))[0]
    ref = dense(q[0], k, v)
    ea = np.linalg.norm(oa - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    eb = np.linalg.norm(ob - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert eb.mean() < ea.mean() * 1.25 + 0.005  # re-encoding from fp8 costs little


def test_bytes_accounting_counts_every_array():
    for cfg in (HiSparseConfig(max_context=4096, max_seqs=3),
                HiSparseConfig(num_kv_heads=2, head_dim=64, warm_tokens=0, page_size=32,
                               max_context=2048, num_pool_pages=17)):
        assert state_bytes(cfg).device == nbytes(init_state(cfg))


def test_capacity_at_1m_default_preset():
    from hisparse_jax.cache.layout import capacity_report
    from hisparse_jax.config import preset
    rep = capacity_report(preset("llama3-8b-1m"), 1 << 20)
    assert rep["capacity_vs_bf16"] >= 2.8
    assert rep["bf16_bytes_per_token"] > 512  # page table counted for the baseline too


def _snapshot(cache):
    return [np.asarray(x).copy() for x in
            (cache.state.page_table, cache.state.seq_lens, cache.state.num_free,
             cache.state.bf16_k)] + [cache.seq_lens.copy(), cache.num_free]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_bad_input_changes_nothing(implementation):
    cfg = HiSparseConfig(**SMALL)
    rng = np.random.default_rng(0)
    k, v = _kv(rng, 900, cfg)
    cache = HiSparseCache(cfg, implementation)
    cache.prefill(0, k, v)
    before = _snapshot(cache)
    bad_calls = [
        (ValueError, "shape", lambda: cache.prefill(1, k[:, :1], v[:, :1])),
        (ValueError, "dtype|float", lambda: cache.prefill(1, k.astype(np.int32), v)),
        (ValueError, "max_context", lambda: cache.prefill(1, *_kv(rng, 2049, cfg))),
        (ValueError, "already holds", lambda: cache.prefill(0, k, v)),
        (ValueError, "seq", lambda: cache.prefill(5, k, v)),
        (ValueError, "shape", lambda: cache.append(k[:1, 0], v[:1, 0])),
        (ValueError, "shape", lambda: cache.attend(np.zeros((2, 3, 64), np.float32))),
    ]
    for exc, msg, call in bad_calls:
        with pytest.raises(exc, match=msg):
            call()
        assert _same(before, _snapshot(cache))


def test_full_pool_refuses_and_changes_nothing(implementation):
    cfg = HiSparseConfig(**{**SMALL, "max_seqs": 2}, num_pool_pages=40)
    rng = np.random.default_rng(0)
    k, v = _kv(rng, 1200, cfg)  # 1200 tokens -> 75 pages, 42 of them cold
    cache = HiSparseCache(cfg, implementation)
    cache.prefill(0, k[:900], v[:900])  # 23 cold pages
    before = _snapshot(cache)
    with pytest.raises(CacheFullError, match="pool full"):
        cache.prefill(1, k, v)
    assert _same(before, _snapshot(cache))
    # Fill to the brim by decode appends, then one more page must be refused.
    cache.prefill(1, k[:700], v[:700])  # 11 cold -> 34 used, 6 free
    steps = 0
    with pytest.raises(CacheFullError):
        for t in range(900, 1200):
            cache.append(np.stack([k[t], k[t]]), np.stack([v[t], v[t]]))
            steps += 1
    assert cache.num_free == int(cache.state.num_free) >= 0
    snap = _snapshot(cache)
    with pytest.raises(CacheFullError):
        cache.append(np.stack([k[0], k[0]]), np.stack([v[0], v[0]]))
    assert _same(snap, _snapshot(cache))
    cache.release(0)
    assert cache.num_free == int(cache.state.num_free)
    cache.append(np.stack([k[0], k[0]]), np.stack([v[0], v[0]]), active=[False, True])


def test_nan_in_one_sequence_never_reaches_another(implementation):
    cfg = HiSparseConfig(**{**SMALL, "budget_tokens": 64})
    rng = np.random.default_rng(3)
    k, v = _kv(rng, 1500, cfg)
    clean = HiSparseCache(cfg, implementation)
    clean.prefill(0, k, v)
    mixed = HiSparseCache(cfg, implementation)
    mixed.prefill(0, k, v)
    kn, vn = k.copy(), v.copy()
    kn[::7] = np.nan
    vn[100:900] = np.inf
    mixed.prefill(1, kn, vn)
    for t in range(40):  # appends move NaN pages through every tier of seq 1
        mixed.append(np.stack([k[t], kn[t]]), np.stack([v[t], vn[t]]))
        clean.append(np.stack([k[t], k[t]]), np.stack([v[t], v[t]]), active=[True, False])
    q = rng.normal(size=(2, cfg.num_q_heads, cfg.head_dim)).astype(np.float32)
    a, b = np.asarray(clean.attend(q))[0], np.asarray(mixed.attend(q))[0]
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)


def test_constant_keys_have_zero_range_and_finite_output(implementation):
    cfg = HiSparseConfig(**SMALL)
    k = np.ones((1000, 2, 64), np.float32) * 0.5
    v = np.linspace(-1, 1, 1000 * 2 * 64).reshape(1000, 2, 64).astype(np.float32)
    cache = HiSparseCache(cfg, implementation)
    cache.prefill(0, k, v)
    out = np.asarray(cache.attend(np.ones((2, cfg.num_q_heads, 64), np.float32)))
    assert np.all(np.isfinite(out))
    ref = dense(np.ones((cfg.num_q_heads, 64)), k, v)
    np.testing.assert_allclose(out[0], ref, atol=0.02)


def test_build_logs_capacity_line_from_layout(caplog):
    import logging

    from hisparse_jax.cache.layout import bf16_paged_bytes
    cfg = HiSparseConfig(max_context=65536, max_seqs=2)
    with caplog.at_level(logging.INFO, logger="hisparse"):
        HiSparseCache(cfg)
    line = next(r.message for r in caplog.records if "HiSparse KV cache" in r.message)
    ratio = 2 * bf16_paged_bytes(cfg, 65536) / state_bytes(cfg).device
    assert f"{ratio:.1f}x capacity vs bf16" in line
