"""Prefix sharing in the cache: one copy of a common prefix, verified hits, prewarm,
eviction under pressure, and page accounting under random interleavings."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from hisparse_jax.cache.handle import CacheFullError, HiSparseCache
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig
from tests.helpers import check_page_accounting


def _kv_for(tokens, hkv=2, d=64):
    """K/V as a pure function of (token, position): equal prefixes give equal K/V,
    as causal attention does in a real model."""
    t = np.asarray(tokens, np.int64)
    pos = np.arange(len(t))
    rng_k = np.sin((t[:, None, None] * 0.37 + pos[:, None, None] * 0.011)
                   * np.arange(1, hkv * d + 1).reshape(1, hkv, d) * 0.13)
    rng_v = np.cos((t[:, None, None] * 0.53 + pos[:, None, None] * 0.007)
                   * np.arange(1, hkv * d + 1).reshape(1, hkv, d) * 0.07)
    return rng_k.astype(np.float32) * 2, rng_v.astype(np.float32)


CFG = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=12288, max_seqs=3,
                     budget_tokens=256)
# Interpret-mode Pallas on a CPU is several times slower than XLA: the tests that
# take `implementation` run it on the same cases at about a third of the tokens
# (same tiers and budget, a shorter max_context).
SMALL_CFG = CFG.replace(max_context=4096)


def _cfg(implementation):
    return SMALL_CFG if implementation == "pallas" else CFG


def test_common_prefix_is_stored_once(implementation):
    """An 8K-token common prefix (2K under Pallas) is stored once and shared."""
    cfg = _cfg(implementation)
    n_prefix = 2048 if implementation == "pallas" else 8192
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 50000, n_prefix)
    a = np.concatenate([prefix, rng.integers(0, 50000, 1500)])
    b = np.concatenate([prefix, rng.integers(0, 50000, 900)])
    cache = HiSparseCache(cfg, implementation, prefix=PrefixIndex(cfg.page_size))
    cache.prefill(0, *_kv_for(a), tokens=a)
    free_after_a = cache.num_free
    cache.prefill(1, *_kv_for(b), tokens=b)
    table = np.asarray(cache.state.page_table)
    shared = [p for p in range(cfg.sink_pages, n_prefix // 16) if table[1, p] >= 0]
    assert len(shared) >= n_prefix // 16 - cfg.sink_pages - 1
    assert all(table[0, p] == table[1, p] for p in shared)  # one copy
    # B stored only its own (non-prefix) cold pages.
    from hisparse_jax.cache.state import num_cold_pages
    own = int(num_cold_pages(cfg, len(b))) - len(shared)
    assert free_after_a - cache.num_free == own == free_after_a - int(cache.state.num_free)
    # B attends exactly as in a fresh cache without sharing.
    fresh = HiSparseCache(cfg, implementation)
    fresh.prefill(1, *_kv_for(b))
    q = rng.normal(size=(3, cfg.num_q_heads, 64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(cache.attend(q))[1], np.asarray(fresh.attend(q))[1])
    # Releasing A keeps the shared pages alive for B (and the index).
    cache.release(0)
    np.testing.assert_array_equal(np.asarray(cache.attend(q))[1], np.asarray(fresh.attend(q))[1])


def test_forced_collision_is_detected_and_not_reused(implementation):
    cfg = _cfg(implementation)
    collide = lambda prev, toks: 12345
    index = PrefixIndex(cfg.page_size, hash_fn=collide)
    cache = HiSparseCache(cfg, implementation, prefix=index)
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 50000, 3000), rng.integers(0, 50000, 3000)
    cache.prefill(0, *_kv_for(a), tokens=a)
    free = cache.num_free
    cache.prefill(1, *_kv_for(b), tokens=b)
    assert index.stats["collisions"] >= 1
    table = np.asarray(cache.state.page_table)
    assert not set(table[0][table[0] >= 0]) & set(table[1][table[1] >= 0])  # nothing reused
    from hisparse_jax.cache.state import num_cold_pages
    assert free - cache.num_free == int(num_cold_pages(cfg, 3000))


# (pool pages, document tokens, big prefill tokens) per implementation. In cold
# pages a document is 342 (xla) / 92 (pallas), big 311 / 80: the pinned document
# and another one leave 16 / 4 of the pool free, so big must evict the unpinned
# one, and then the other document no longer fits.
PREWARM = {"xla": (700, 6000, 5500), "pallas": (188, 2000, 1800), "cpu": (700, 6000, 5500)}


def test_prewarm_is_reused_and_unpinned_prefixes_are_evicted_first(implementation):
    pool, n_doc, n_big = PREWARM[implementation]
    cfg = _cfg(implementation).replace(num_pool_pages=pool)
    cache = HiSparseCache(cfg, implementation, prefix=PrefixIndex(cfg.page_size))
    rng = np.random.default_rng(2)
    doc = rng.integers(0, 50000, n_doc)
    cache.prewarm("manual", doc, *_kv_for(doc))
    assert cache.seq_lens.sum() == 0 and cache.num_free < pool  # pinned pages stay
    pinned_free = cache.num_free
    q = np.concatenate([doc, rng.integers(0, 50000, 500)])
    cache.prefill(0, *_kv_for(q), tokens=q)
    assert pinned_free - cache.num_free <= 40  # only the new tail was stored
    cache.release(0)
    # An unpinned, unused prefix is evicted when the pool runs short; pinned stays.
    other = rng.integers(0, 50000, n_doc)
    cache.prefill(1, *_kv_for(other), tokens=other)
    cache.release(1)
    big = rng.integers(0, 50000, n_big)
    cache.prefill(2, *_kv_for(big), tokens=big)  # needs the unpinned pages back
    n, _ = cache.prefix.match(doc)
    assert n == len(doc) // cfg.page_size  # the prewarmed document is still indexed
    with pytest.raises(CacheFullError):
        cache.prefill(0, *_kv_for(other), tokens=other)  # pinned + live: no room


OPS = hs.lists(hs.tuples(hs.sampled_from(["prefill", "append", "release", "prewarm", "evict"]),
                         hs.integers(0, 2), hs.integers(0, 3), hs.integers(600, 2600)),
               min_size=3, max_size=10)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_page_accounting_never_leaks_or_aliases(ops):
    cfg = CFG.replace(max_context=4096, num_pool_pages=600)
    cache = HiSparseCache(cfg, prefix=PrefixIndex(cfg.page_size))
    bases = [np.random.default_rng(s).integers(0, 50000, 4096) for s in range(4)]
    tokens, prefilled = {}, {}  # per live sequence: all its tokens, how many by prefill
    for op, seq, base, n in ops:
        try:
            if op == "prefill" and cache.seq_lens[seq] == 0:
                toks = bases[base][:n].copy()
                toks[n // 2:] += seq + 1  # sequences diverge half way
                cache.prefill(seq, *_kv_for(toks), tokens=toks)
                tokens[seq] = list(toks)
                prefilled[seq] = len(toks)
            elif op == "append" and cache.seq_lens.any():
                new = [int(bases[base][-1 - i]) for i in range(3)]
                for tk in new:
                    kk = np.zeros((cfg.max_seqs, 2, 64), np.float32)
                    vv = np.zeros_like(kk)
                    active = cache.seq_lens > 0
                    for s in np.flatnonzero(active):
                        seq_toks = tokens[s] + [tk]
                        k1, v1 = _kv_for(seq_toks)
                        kk[s], vv[s] = k1[-1], v1[-1]
                        tokens[s] = seq_toks
                    cache.append(kk, vv, active=active)
            elif op == "release" and cache.seq_lens[seq]:
                cache.release(seq)
                tokens.pop(seq)
                prefilled.pop(seq)
            elif op == "prewarm" and (cache.seq_lens == 0).any():
                doc = bases[base][:n]
                if f"doc{base}-{n}" not in cache.prefix.contexts:
                    cache.prewarm(f"doc{base}-{n}", doc, *_kv_for(doc))
            elif op == "evict":
                for ctx in list(cache.prefix.contexts):
                    cache.prefix.unpin(ctx)
                cache._make_room(cache.num_free + 1 if cache.num_free < cfg.pool_pages else 0)
        except CacheFullError:
            pass
        check_page_accounting(cache)  # refcounts, free stack, num_free: no leak, no alias
    # Every live sequence attends exactly as a fresh cache given the same prefill and
    # the same appends (shared pages hold the same bytes it would have encoded).
    q = np.random.default_rng(9).normal(size=(cfg.max_seqs, cfg.num_q_heads, 64)).astype(np.float32)
    out = np.asarray(cache.attend(q))
    for s, toks in tokens.items():
        fresh = HiSparseCache(cfg)
        k_all, v_all = _kv_for(toks)
        n0 = prefilled[s]
        fresh.prefill(s, k_all[:n0], v_all[:n0])
        only = np.arange(cfg.max_seqs) == s
        for t in range(n0, len(toks)):
            kk = np.zeros((cfg.max_seqs, 2, 64), np.float32)
            vv = np.zeros_like(kk)
            kk[s], vv[s] = k_all[t], v_all[t]
            fresh.append(kk, vv, active=only)
        np.testing.assert_array_equal(out[s], np.asarray(fresh.attend(q))[s])
