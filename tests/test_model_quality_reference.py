"""The reference selections of `benchmarks/model_quality.py nexttoken` (oracle and
plain Quest over unquantized K/V) against a brute-force numpy version that takes
the tiers from the cache's own `evaluation.always_attended`: they bound what page
selection can reach on real text, so they must select exactly what they claim."""

import importlib.util
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.attention import causal_prefill_attention
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness.evaluation import always_attended

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "model_quality", os.path.join(ROOT, "benchmarks", "model_quality.py"))
model_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_quality)

T, START = 1024, 512  # START and T - START multiples of the query chunk (256)


def _qkv(seed, hkv, g, d):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, hkv * g, d)).astype(np.float32) * 1.5
    k = rng.standard_normal((T, hkv, d)).astype(np.float32)
    k[:, :, 3] += 4.0  # an outlier channel, so pages' ranges differ
    v = rng.standard_normal((T, hkv, d)).astype(np.float32)
    # bf16 inputs as the model gives them; compare on the same rounded values
    return (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))


def _brute(cfg, q, k, v, select, budget_pages):
    t, hq, d = q.shape
    hkv = k.shape[1]
    g, pg = hq // hkv, cfg.page_size
    out = np.zeros((t - START, hq, d))
    for i, pos in enumerate(range(START, t)):
        n = pos + 1
        always = always_attended(cfg, n)
        page = np.arange(n) // pg
        cold_pages = np.unique(page[~always])
        for h in range(hkv):
            qs = q[pos, h * g:(h + 1) * g].astype(np.float64)
            s = qs @ k[:n, h].T.astype(np.float64) / math.sqrt(d)        # [G, n]
            if select == "oracle":
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                score = np.array([p[:, page == c].sum() for c in cold_pages])
            else:
                score = np.array([max(
                    (np.maximum(qs[j], 0) @ k[:n][page == c, h].max(0)
                     + np.minimum(qs[j], 0) @ k[:n][page == c, h].min(0)) for j in range(g))
                    for c in cold_pages])
            chosen = cold_pages[np.argsort(-score, kind="stable")[:budget_pages]]
            keep = always | np.isin(page, chosen)
            w = np.where(keep, np.exp(s - s[:, keep].max(-1, keepdims=True)), 0)
            w /= w.sum(-1, keepdims=True)
            out[i, h * g:(h + 1) * g] = w @ v[:n, h]
    return out


@pytest.mark.parametrize("select,hkv,g,budget_pages,seed", [
    ("oracle", 3, 3, 4, 0), ("quest", 3, 3, 4, 1), ("oracle", 2, 1, 7, 2), ("quest", 1, 4, 2, 3)])
def test_reference_selection_attends_exactly_its_pages(select, hkv, g, budget_pages, seed):
    d = 32
    cfg = HiSparseConfig(num_kv_heads=hkv, gqa_group=g, head_dim=d, value_group=16, max_context=T,
                         budget_tokens=budget_pages * 16)
    q, k, v = _qkv(seed, hkv, g, d)
    got = np.asarray(model_quality._selected_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), select=select,
        budget_pages=budget_pages, start=START, cfg=cfg))
    exact = np.asarray(causal_prefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    np.testing.assert_array_equal(got[:START], exact[:START])  # prefill stays exact
    want = _brute(cfg, q, k, v, select, budget_pages)
    np.testing.assert_allclose(got[START:], want, atol=2e-5)
    # and it is a real selection: far from exact attention over every page
    assert np.abs(got[START:] - exact[START:]).max() > 0.05


def test_reference_selection_with_every_page_is_exact():
    d = 32
    cfg = HiSparseConfig(num_kv_heads=3, gqa_group=3, head_dim=d, value_group=16, max_context=T)
    q, k, v = _qkv(7, 3, 3, d)
    got = model_quality._selected_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), select="oracle",
        budget_pages=T // 16, start=START, cfg=cfg)
    exact = causal_prefill_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=2e-6)
