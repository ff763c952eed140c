"""Several caches in one process (e.g. two models) never share or overwrite pages."""

import numpy as np

from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import HiSparseConfig


def _run(cache, rng_seed, steps):
    rng = np.random.default_rng(rng_seed)
    c = cache.cfg
    k = rng.normal(size=(1500, c.num_kv_heads, c.head_dim)).astype(np.float32)
    cache.prefill(0, k, k * 0.5)
    outs = []
    for t in range(steps):
        kk = rng.normal(size=(c.max_seqs, c.num_kv_heads, c.head_dim)).astype(np.float32)
        cache.append(kk, kk)
        q = rng.normal(size=(c.max_seqs, c.num_q_heads, c.head_dim)).astype(np.float32)
        outs.append(np.asarray(cache.attend(q)))
    return outs


def test_two_caches_interleaved_equal_alone(implementation):
    a_cfg = HiSparseConfig(num_kv_heads=2, gqa_group=4, head_dim=64, max_context=2048,
                           budget_tokens=128)
    b_cfg = HiSparseConfig(num_kv_heads=4, gqa_group=2, head_dim=128, page_size=32,
                           max_context=2048, budget_tokens=256)
    alone_a = _run(HiSparseCache(a_cfg, implementation), 1, 20)
    alone_b = _run(HiSparseCache(b_cfg, implementation), 2, 20)
    a, b = HiSparseCache(a_cfg, implementation), HiSparseCache(b_cfg, implementation)
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(2)
    ka = rng_a.normal(size=(1500, 2, 64)).astype(np.float32)
    kb = rng_b.normal(size=(1500, 4, 128)).astype(np.float32)
    a.prefill(0, ka, ka * 0.5)
    b.prefill(0, kb, kb * 0.5)
    for t in range(20):  # interleave every update and read
        xa = rng_a.normal(size=(1, 2, 64)).astype(np.float32)
        a.append(xa, xa)
        xb = rng_b.normal(size=(1, 4, 128)).astype(np.float32)
        b.append(xb, xb)
        qa = rng_a.normal(size=(1, 8, 64)).astype(np.float32)
        qb = rng_b.normal(size=(1, 8, 128)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(a.attend(qa)), alone_a[t])
        np.testing.assert_array_equal(np.asarray(b.attend(qb)), alone_b[t])
