"""Quality of selection and quantization on the realistic generated workloads
(DESIGN §4), default preset, ~2K-token cold budget. Thresholds are the issue's;
the negative tests show they fail when selection or quantization is degraded."""

import jax
import numpy as np
import pytest

from hisparse_jax.attention import selection
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig
from hisparse_jax.harness.evaluation import evaluate, needle_pages_hit, needles_found
from hisparse_jax.harness.workloads import CONCENTRATED, HEAD_KINDS, make_workload

CASES = {"32k": (32768, 11), "128k": (131072, 12)}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    context, seed = CASES[request.param]
    w = make_workload(context=context, num_kv_heads=4, gqa_group=4, head_dim=128,
                      num_queries=16, seed=seed)
    ev = evaluate(HiSparseConfig(), w.q, w.k, w.v)
    kinds = np.array(w.head_kinds)
    return request.param, w, ev, kinds


def _heads(kinds, names):
    return np.flatnonzero(np.isin(kinds, names))


def test_concentrated_heads(case):
    name, _, ev, kinds = case
    s = ev.summary(_heads(kinds, CONCENTRATED))
    print(name, s)
    assert s["recall_p5"] >= 0.85
    # Selection close to the oracle that keeps the truly heaviest pages under the
    # same budget: what is left is mass no 2K-token selection can reach here.
    assert s["recall_vs_oracle"] >= 0.98
    # Measured 0.9667 / 0.9503 at 32K / 128K (the oracle: 0.9684 / 0.9530); without
    # the re-rank 128K gave 0.9486 (docs/log/results.md).
    assert s["recall_mean"] >= 0.95
    # The mass left out is estimated from a sample of the unselected pages
    # (measured 0.016 / 0.020 at 32K / 128K); selection alone cannot get there,
    # not even the oracle's (0.056).
    assert s["selection_error_mean"] <= 0.03
    assert s["unsampled_selection_error_mean"] > 0.03
    assert s["unsampled_selection_error_mean"] <= s["oracle_selection_error_mean"] + 0.015


def test_every_head_kind_vs_oracle(case):
    _, _, ev, kinds = case
    for kind in np.unique(kinds):
        s = ev.summary(_heads(kinds, [kind]))
        assert s["recall_mean"] >= 0.9 * s["oracle_recall_mean"], (kind, s)


def test_needles_found_at_every_depth(case):
    _, w, ev, _ = case
    found, total = needles_found(ev, w.needle_targets)
    assert total >= 30 and found == total
    # Every page a planted needle touches, its 1-2 token tails included (they
    # are caught as the pages beside each head's top bound page).
    hit, pages = needle_pages_hit(ev, w.needle_targets)
    print("needles", found, total, "needle pages", hit, pages,
          "pages >= 1%", needle_pages_hit(ev, w.needle_targets, min_mass=0.01))
    assert hit == pages  # measured: 118/118 at 32K, 108/108 at 128K


def test_quantization_alone(case):
    """--budget-tokens all: every page attended, only quantization error left."""
    _, _, ev, _ = case
    s = ev.summary()
    assert s["quant_error_mean"] <= 0.04 and s["quant_error_p95"] <= 0.10


def test_mixed_kind_groups():
    """Trained models mix head kinds within a GQA group. The shared selection then
    favours the concentrated heads: diffuse ones get ~0.80 of the oracle's recall
    at 32K (docs/log/results.md, "Mixed GQA groups"). The concentrated heads keep
    their thresholds, every needle is found, and the tail estimate keeps the
    diffuse heads' output error near the same-kind figure (measured 0.128 here,
    0.125 with same-kind groups, 0.288 without the tail estimate)."""
    kinds = [HEAD_KINDS[(h + g) % len(HEAD_KINDS)] for h in range(4) for g in range(4)]
    w = make_workload(context=32768, num_kv_heads=4, gqa_group=4, head_dim=128,
                      num_queries=16, seed=11, kinds=kinds)
    ev = evaluate(HiSparseConfig(), w.q, w.k, w.v)
    kinds = np.array(w.head_kinds)
    conc = ev.summary(_heads(kinds, CONCENTRATED))
    print("mixed", conc)
    assert conc["recall_mean"] >= 0.95 and conc["recall_p5"] >= 0.85
    assert conc["recall_vs_oracle"] >= 0.98
    assert conc["selection_error_mean"] <= 0.03
    found, total = needles_found(ev, w.needle_targets)
    assert total >= 30 and found == total
    diffuse = ev.summary(_heads(kinds, ["diffuse"]))
    print("mixed diffuse", diffuse)
    assert diffuse["selection_error_mean"] <= 0.2
    assert diffuse["selection_error_mean"] <= 0.6 * diffuse["unsampled_selection_error_mean"]


def test_random_pages_fail(case, monkeypatch):
    """Replacing selection with random cold pages must break the thresholds."""
    _, w, ev, kinds = case
    cfg = ev.config
    rng = np.random.default_rng(0)
    n_cold = cfg.max_pages - cfg.sink_pages - cfg.hot_pages - cfg.warm_pages

    real_select = selection._select

    def random_select(cfg_, state, q, implementation, stacked=None):
        _, mass = real_select(cfg_, state, q, implementation, stacked)  # the tail sample stays
        pages = rng.choice(n_cold, size=(q.shape[0], cfg_.num_kv_heads, cfg_.budget_pages))
        return jax.numpy.asarray(pages + cfg_.sink_pages, jax.numpy.int32), mass
    monkeypatch.setattr(selection, "_select", random_select)
    jax.clear_caches()
    bad = evaluate(HiSparseConfig(), w.q, w.k, w.v)
    jax.clear_caches()
    found, total = needles_found(bad, w.needle_targets)
    s = bad.summary(_heads(kinds, CONCENTRATED))
    assert found < 0.5 * total
    assert s["recall_p5"] < 0.85 or s["recall_vs_oracle"] < 0.98


def test_coarser_quantization_fails(case, monkeypatch):
    """int2 instead of int4 (same packing, 3 levels) must break the quant thresholds."""
    from pallas_kernels.quant import reference as qref
    w = case[1]
    monkeypatch.setattr(qref, "INT4_LEVELS", 3.0)
    jax.clear_caches()
    s = evaluate(HiSparseConfig(budget_tokens=FULL_BUDGET), w.q[:4], w.k, w.v).summary()
    jax.clear_caches()
    assert s["quant_error_mean"] > 0.04 or s["quant_error_p95"] > 0.10
