"""`evaluation.ExactMass` (page masses, a few queries at a time) against the DESIGN §4
definitions written out on the full [N, Hq, S] weights in float64."""

import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness.evaluation import ExactMass, always_attended, config_for

# (context, KV heads, GQA group, head_dim): odd lengths, several GQA ratios.
CASES = [(1000, 2, 1, 32), (2053, 1, 8, 64), (3001, 2, 4, 64), (600, 3, 2, 32)]


def _exact(q, k):
    _, hq, d = q.shape
    g = hq // k.shape[1]
    logits = np.einsum("nhd,shd->nhs", q.astype(np.float64),
                       np.repeat(k, g, axis=1).astype(np.float64)) / np.sqrt(d)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def _attended(cfg, s, pages):
    """[N, Hkv, S] bool, token by token."""
    always = always_attended(cfg, s)
    tokens = np.arange(s)
    att = np.zeros((*pages.shape[:2], s), bool)
    for n in range(pages.shape[0]):
        for h in range(pages.shape[1]):
            chosen = pages[n, h][pages[n, h] >= 0]
            att[n, h] = always | np.isin(tokens // cfg.page_size, chosen)
    return att


@pytest.mark.parametrize("s,hkv,g,d", CASES)
@pytest.mark.parametrize("chunk_bytes", [1, 1 << 28])  # one query per chunk / all at once
def test_exact_mass_matches_token_level_definitions(s, hkv, g, d, chunk_bytes):
    rng = np.random.default_rng(s + g)
    n, hq = 3, hkv * g
    # Peaky attention: a few keys strongly aligned with each query.
    k = rng.normal(size=(s, hkv, d)).astype(np.float32)
    q = (3.0 * rng.normal(size=(n, hq, d))).astype(np.float32)
    cfg = config_for(HiSparseConfig(), k, g)
    exact = ExactMass.compute(cfg, q, k, chunk_bytes=chunk_bytes)
    w = _exact(q, k)
    npg = -(-s // cfg.page_size)

    pages = rng.integers(0, npg, size=(n, hkv, 9))
    pages[0, 0, :3] = -1          # unused slots
    pages[-1, -1, 1] = pages[-1, -1, 0]  # a repeated page counts once
    att = np.repeat(_attended(cfg, s, pages), g, axis=1)
    np.testing.assert_allclose(exact.recall(pages), np.where(att, w, 0).sum(-1), atol=2e-5)
    top10 = np.argsort(-w, axis=-1)[..., :10]
    np.testing.assert_allclose(exact.top10_recall(pages),
                               np.take_along_axis(att, top10, -1).mean(-1))
    assert exact.attended_fraction(pages) == pytest.approx(att[:, ::g].mean())
    np.testing.assert_allclose(exact.token_weights(1), w[1], atol=1e-6)

    # The oracle: the budget's heaviest cold pages by group mass, and no random
    # selection of as many pages recalls more.
    budget = 5
    oracle = exact.oracle(budget)
    cold = np.where(always_attended(cfg, s), 0.0, w)
    cold = np.pad(cold, ((0, 0), (0, 0), (0, npg * cfg.page_size - s)))
    group = cold.reshape(n, hkv, g, npg, cfg.page_size).sum(axis=(2, 4))
    want = np.sort(group, axis=-1)[..., ::-1][..., :budget].sum(-1)
    got = np.take_along_axis(group, np.maximum(oracle, 0), -1).sum(-1, where=oracle >= 0)
    np.testing.assert_allclose(got, want, atol=2e-5)
    best = exact.recall(oracle).reshape(n, hkv, g).sum(-1)
    for _ in range(20):
        other = rng.integers(0, npg, size=(n, hkv, budget))
        assert np.all(exact.recall(other).reshape(n, hkv, g).sum(-1) <= best + 2e-5)


def test_evaluate_reads_float16_and_float64_inputs_exactly():
    """float16 captures stay float16 on the host (half the memory); float16 -> float32
    is exact, so the result equals that of the same values passed as float32.
    float64 is accepted too (read as float32)."""
    from hisparse_jax.harness.evaluation import evaluate
    from hisparse_jax.harness.workloads import make_workload
    w = make_workload(context=2000, num_kv_heads=2, gqa_group=2, head_dim=64, num_queries=2,
                      seed=4)
    k16, v16 = w.k.astype(np.float16), w.v.astype(np.float16)
    cfg = HiSparseConfig(budget_tokens=256)
    a = evaluate(cfg, w.q, k16, v16).summary()
    b = evaluate(cfg, w.q, k16.astype(np.float32), v16.astype(np.float32)).summary()
    c = evaluate(cfg, w.q, k16.astype(np.float64), v16.astype(np.float64)).summary()
    assert a == b == c
