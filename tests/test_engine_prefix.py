"""Prefix sharing in the model engine: a prompt that starts like an indexed one
references its cold pool pages (every layer) instead of storing them again, with
results bit-equal to the prompt served alone; the pool evicts unused prefixes,
never pinned or referenced ones; a poisoned prompt is never indexed."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from models_fixtures import smollm2

from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import CacheFullError
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.llama import Llama, LlamaConfig, random_weights


@pytest.fixture(scope="module")
def model():
    return smollm2()


def test_a_shared_prefix_is_referenced_not_stored(model):
    """b = a's first 650 tokens + 60 others. Slot 1 (b, the server's chunked path)
    references a's cold pages in every layer; its logits and decoded tokens are
    bit-equal to b served alone, also after a's slot is released."""
    m, tok = model
    a = np.asarray(tok.encode("The grass is green. The sky is blue. The sun is yellow. " * 80)[:700])
    other = np.asarray(tok.encode("Cats and dogs play in the garden all day long. " * 10))
    b = np.concatenate([a[:650], other[:60]])
    eng, alone = (Engine(m, max_seqs=2, max_context=1024) for _ in range(2))
    c = eng.cache_cfg
    eng.prefill(0, a)
    free = eng.num_free
    assert eng.prefill_chunk(1, b, 0) is None
    first = eng.prefill_chunk(1, b, PREFILL_CHUNK)
    want = (alone.prefill_chunk(1, b, 0), alone.prefill_chunk(1, b, PREFILL_CHUNK))[1]
    assert first == want
    np.testing.assert_array_equal(np.asarray(eng.logits), np.asarray(alone.logits))
    cold_a, cold_b = (int(st.num_cold_pages(c, len(x))) for x in (a, b))
    shared = range(c.sink_pages, c.sink_pages + cold_a)  # a's cold pages, all in b's prefix
    assert free - eng.num_free == cold_b - cold_a  # b stored only what a did not hold
    tables = np.asarray(eng.caches.page_table)  # [L, B, pages]
    np.testing.assert_array_equal(tables[:, 1, shared], tables[:, 0, shared])
    assert (tables[:, 1, c.sink_pages + cold_a] >= 0).all()
    assert not np.isin(tables[:, 1, c.sink_pages + cold_a], tables[:, 0]).any()
    # a's sink and cold pages are indexed (its window's are its own); b's lookup
    # hits them all, counted once (at the fill, not at the first block)
    assert eng.prefix_stats()["hits"] == c.sink_pages + cold_a
    only_b = np.array([False, True])
    for step in range(6):
        if step == 3:
            eng.release(0)  # a's pages stay: b references them
        got = eng.decode_step(np.array([step < 3, True]))
        assert got[1] == alone.decode_step(only_b)[1]
        np.testing.assert_array_equal(np.asarray(eng.logits)[1], np.asarray(alone.logits)[1])
    eng.release(1)
    assert eng.pool_usage()[0] == 0  # nothing in use: the indexed pages are only cached
    assert eng.prefix_stats()["cached_pages"] == cold_b  # a's, and b's one beyond them
    assert eng.pool_available() == c.pool_pages


def _tiny(pool_pages):
    """A two-layer random model's engine with a pool of `pool_pages` per layer."""
    mc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position=2048)
    return Engine(Llama(mc, random_weights(mc)), max_seqs=2, max_context=2048,
                  budget_tokens=256, cache_overrides={"num_pool_pages": pool_pages})


def test_the_pool_evicts_unused_prefixes_never_pinned_or_referenced_ones():
    eng = _tiny(8)
    c = eng.cache_cfg
    n = (c.sink_pages + c.hot_pages + c.warm_pages + 4) * c.page_size  # 4 cold pages
    doc, b, d, e = (np.arange(n) * k % 251 for k in (1, 3, 5, 7))
    eng.prefill(0, doc)
    eng.pin(0, "doc")
    eng.release(0)
    assert eng.prefix_stats()["pinned_pages"] == 4 and eng.num_free == 4
    eng.prefill(0, b)
    eng.release(0)  # b's pages stay indexed, unused: cached, counted as available
    assert eng.num_free == 0 and eng.pool_available() == 4
    eng.prefill(1, d)  # needs 4: b's go (oldest unused first), the pinned doc's stay
    assert eng.prefix_stats()["evictions"] == 4 and eng.prefix_stats()["pinned_pages"] == 4
    with pytest.raises(CacheFullError, match="4 more are needed"):
        eng.prefill(0, e)  # nothing evictable: the doc is pinned, d is live
    assert eng.lens[0] == 0 and eng.num_free == 0
    eng.prefill(0, np.concatenate([doc[:-5], [9] * 5]))  # the doc's cold pages: shared
    assert eng.num_free == 0
    eng.unpin("doc")
    eng.prefill(1, e)  # d's slot emptied first; its pages go, not the doc's (slot 0's)
    stats = eng.prefix_stats()
    assert (stats["evictions"], stats["pinned_pages"], stats["cached_pages"]) == (8, 0, 0)
    eng.release(0)  # the doc's pages: unpinned and now unused, so cached
    assert eng.prefix_stats()["cached_pages"] == 4 and eng.pool_available() == 4


def test_a_poisoned_prompt_is_never_indexed():
    """K/V with a NaN poison the sequence; its pages must never reach another one."""
    eng = _tiny(16)
    c, mc = eng.cache_cfg, eng.model.cfg
    n = (c.sink_pages + c.hot_pages + c.warm_pages + 4) * c.page_size
    ids = np.arange(n) % 251
    k = np.zeros((mc.num_layers, n, mc.num_kv_heads, mc.head_dim), np.float32)
    k[:, 20] = np.nan
    eng.prefill_kv(0, k, k, next_token=1, ids=ids)
    assert np.asarray(eng.caches.poisoned)[:, 0].all()
    assert not any(e.pages for e in eng.prefix.entries.values())
    free = eng.num_free
    eng.prefill(1, ids)  # stores its own pages
    assert free - eng.num_free == 4
    assert not np.asarray(eng.caches.poisoned)[:, 1].any()
    with pytest.raises(ValueError, match="3 token ids for K/V of"):
        eng.prefill_kv(0, k, k, next_token=1, ids=ids[:3])


def test_a_new_slot_or_prompt_length_compiles_nothing(model, caplog):
    """After one chunked prompt of 3,000 tokens, another in the other slot and one of
    3,400 (different tokens: nothing shared) compile no program. Indexing the
    prompt's pages reads its page table through one program for every slot and
    length (with Python ints it compiled one per slot and per page count), and
    both lengths fill the cache from 4,096 staged positions
    (`fill_length`; whole blocks, 3,072 and 3,584, made a fill program each).
    Their last blocks (440 and 328 tokens) both take 512 rows; a last block of
    at most 256 tokens would compile its own size once (`Engine.block_length`)."""
    m, _ = model
    rng = np.random.default_rng(0)
    # a pool that holds all three prompts: no eviction (whose page references
    # compile per power of two of pages evicted)
    eng = Engine(m, max_seqs=2, max_context=4096, cache_overrides={"num_pool_pages": 1024})

    def serve(slot, n):
        ids = rng.integers(0, m.cfg.vocab_size, n)
        firsts = [eng.prefill_chunk(slot, ids, start) for start in range(0, n, PREFILL_CHUNK)]
        assert firsts[-1] is not None
        eng.release(slot)

    serve(0, 3000)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG, logger="jax"):
            serve(1, 3000)
            serve(0, 3400)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [r.getMessage()[:80] for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiled == []
