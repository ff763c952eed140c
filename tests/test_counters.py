"""Counters for a metrics endpoint: tokens per tier agree with the slots the
state actually holds live, prefix collisions are counted, and the offloaded
cache adds the scheduler's counts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.offload.store import OffloadedCache

CFG = HiSparseConfig(num_kv_heads=1, head_dim=64, gqa_group=1, max_context=2048, max_seqs=4,
                     budget_tokens=64)


@pytest.mark.parametrize("lengths", [(1, 100, 700, 0), (16, 17, 144, 2048), (528, 529, 0, 33)])
def test_tier_counts_match_live_slots(lengths):
    cache = HiSparseCache(CFG, implementation="xla")
    for b, n in enumerate(lengths):
        if n:
            x = np.zeros((n, 1, 64), np.float32)
            cache.prefill(b, x, x)
    c = cache.counters()
    bf16_pos, fp8_pos = (np.asarray(p) for p in
                         st.slot_positions(CFG, jnp.asarray(cache.seq_lens, jnp.int32)))
    assert c["sink_tokens"] + c["hot_tokens"] == int((bf16_pos >= 0).sum())
    assert c["warm_tokens"] == int((fp8_pos >= 0).sum())
    assert c["cold_pages"] == int((np.asarray(cache.state.page_table) >= 0).sum())
    assert c["sink_tokens"] + c["hot_tokens"] + c["warm_tokens"] \
        + c["cold_pages"] * CFG.page_size == sum(lengths)
    assert c["pool_pages_used"] + c["pool_pages_free"] == CFG.pool_pages


def test_prefix_collisions_and_offload_counters():
    index = PrefixIndex(CFG.page_size, hash_fn=lambda prev, toks: 7)  # every page collides
    cache = HiSparseCache(CFG, implementation="xla", prefix=index)
    rng = np.random.default_rng(0)
    for b in range(2):
        x = rng.normal(size=(1000, 1, 64)).astype(np.float32)
        cache.prefill(b, x, x, tokens=rng.integers(0, 1000, 1000))
    assert cache.counters()["prefix_collisions"] == index.stats["collisions"] >= 1
    plain = HiSparseCache(CFG, implementation="xla")
    x = rng.normal(size=(1000, 1, 64)).astype(np.float32)
    plain.prefill(0, x, x)
    off = OffloadedCache(plain)
    off.attend(rng.normal(size=(4, 1, 64)).astype(np.float32))
    c = off.counters()
    assert c["cold_pages"] == plain.counters()["cold_pages"] > 0
    assert c["selected"] == c["hits"] + c["misses"] == c["resident_pages"] > 0
