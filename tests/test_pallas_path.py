"""The library's own call path with implementation="pallas" (interpret mode on a
CPU) against implementation="xla": HiSparseCache prefill + appends + attend, and
`evaluate`. Selections must be identical and outputs equal to f32 tolerance
(bf16x3 dots: rtol 1e-4, atol 2e-5, as tests/test_kernels.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness.evaluation import evaluate
from hisparse_jax.harness.workloads import make_workload

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

RTOL, ATOL = 1e-4, 2e-5


def _cfg(page, gqa):
    # Small tiers so that appends move pages hot -> warm -> cold, and a budget of
    # 4 cold pages so that selection matters.
    return HiSparseConfig(num_kv_heads=2, head_dim=64, page_size=page, gqa_group=gqa,
                          sink_tokens=16, hot_tokens=64, warm_tokens=128,
                          budget_tokens=4 * page, max_context=2048, max_seqs=2)


def _kv(rng, s, cfg):
    shape = (s, cfg.num_kv_heads, cfg.head_dim)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


def _build(cfg, impl, k, v, n0, other):
    """Seq 0: prefill n0 tokens of k, v, then append the rest one token at a time.
    Seq 1 (`other`): None (empty) or (k1, v1) with NaN keys, prefilled; either way it
    is inactive during the appends and handed NaN junk."""
    cache = HiSparseCache(cfg, implementation=impl)
    cache.prefill(0, k[:n0], v[:n0])
    if other is not None:
        cache.prefill(1, *other)
    junk = np.full_like(k[0], np.nan)
    for t in range(n0, k.shape[0]):
        cache.append(np.stack([k[t], junk]), np.stack([v[t], junk]), active=[True, False])
    return cache


def _attend(cache, q):
    out, sel = cache.attend(q, return_selection=True)
    return np.asarray(out), np.asarray(sel)


@pytest.mark.parametrize("page,gqa,n0,n,nan_seq", [
    (16, 1, 301, 389, False),
    (16, 4, 777, 819, True),
    (32, 1, 1001, 1051, True),
    (32, 4, 523, 597, False),
])
def test_cache_pallas_equals_xla(page, gqa, n0, n, nan_seq):
    cfg = _cfg(page, gqa)
    rng = np.random.default_rng(page * 100 + gqa)
    k, v = _kv(rng, n, cfg)
    other = None
    if nan_seq:
        k1, v1 = _kv(rng, 643, cfg)
        k1[::7] = np.nan
        v1[100:300] = np.inf
        other = (k1, v1)
    q = rng.normal(size=(2, cfg.num_q_heads, cfg.head_dim)).astype(np.float32)
    q[0, 0] *= 8.0  # one peaked head

    caches = {impl: _build(cfg, impl, k, v, n0, other) for impl in ("xla", "pallas")}
    # The implementation picks attention kernels only: both caches hold the same bytes.
    for name, a in caches["xla"].state.__dict__.items():
        b = getattr(caches["pallas"].state, name)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    (ox, sx), (op, sp) = (_attend(caches[i], q) for i in ("xla", "pallas"))
    assert sx.shape == (2, cfg.num_kv_heads, cfg.budget_pages)
    np.testing.assert_array_equal(sp[0], sx[0])
    assert np.all(sx[0] >= 0)  # budget filled: enough cold pages
    assert np.all(np.isfinite(op[0]))
    np.testing.assert_allclose(op[0], ox[0], rtol=RTOL, atol=ATOL)
    if nan_seq:  # the NaN sequence: same selection and same output (NaN where XLA has NaN)
        np.testing.assert_array_equal(sp[1], sx[1])
        np.testing.assert_allclose(op[1], ox[1], rtol=RTOL, atol=ATOL, equal_nan=True)
    else:  # the empty sequence: nothing selected, zeros
        assert np.all(sx[1] == -1) and np.all(sp[1] == -1)
        assert np.all(op[1] == 0) and np.all(ox[1] == 0)
    # A second decode step: both favour the pages the first one selected (sticky).
    for name in ("last_selected", "page_table"):
        np.testing.assert_array_equal(np.asarray(getattr(caches["xla"].state, name)),
                                      np.asarray(getattr(caches["pallas"].state, name)))
    q2 = (q + 0.5 * rng.normal(size=q.shape)).astype(np.float32)
    (ox2, sx2), (op2, sp2) = (_attend(caches[i], q2) for i in ("xla", "pallas"))
    np.testing.assert_array_equal(sp2[0], sx2[0])
    np.testing.assert_allclose(op2[0], ox2[0], rtol=RTOL, atol=ATOL)


def test_evaluate_pallas_equals_xla():
    w = make_workload(context=2048, num_kv_heads=2, gqa_group=4, head_dim=64, num_queries=3,
                      needles_per_head=2, seed=5)
    cfg = HiSparseConfig(budget_tokens=256)
    ev = {impl: evaluate(cfg, w.q, w.k, w.v, implementation=impl) for impl in ("xla", "pallas")}
    np.testing.assert_array_equal(ev["pallas"].selected_pages, ev["xla"].selected_pages)
    assert np.all(ev["xla"].selected_pages >= 0)
    sx, sp = ev["xla"].summary(), ev["pallas"].summary()
    assert sx.keys() == sp.keys()
    for key in sx:
        assert sp[key] == pytest.approx(sx[key], rel=1e-4, abs=1e-6), key
    for field in ("recall", "oracle_recall", "top10_recall"):
        np.testing.assert_allclose(getattr(ev["pallas"], field), getattr(ev["xla"], field),
                                   rtol=1e-5, atol=1e-6)
    for field in ("rel_error", "selection_error", "oracle_selection_error", "quant_error"):
        np.testing.assert_allclose(getattr(ev["pallas"], field), getattr(ev["xla"], field),
                                   rtol=1e-3, atol=1e-5)
