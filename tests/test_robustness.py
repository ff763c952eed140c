"""Bad input never corrupts a cache (issue 17): every refused call raises a clear
error and leaves the whole cache as it was (device state, host mirrors, prefix
index, host pool, working set), and nothing wrong is accepted silently."""

import numpy as np
import pytest

from hisparse_jax import capacity
from hisparse_jax.cache import pressure
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.offload.store import OffloadedCache
from tests.helpers import assert_same_snapshot, cache_snapshot, check_page_accounting, cli_error

CFG = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=32, max_context=1024,
                     max_seqs=2, budget_tokens=64, hot_tokens=32, warm_tokens=32,
                     sink_tokens=16, value_group=16)
RNG = np.random.default_rng(17)
K = RNG.normal(size=(700, 2, 32)).astype(np.float32)
V = RNG.normal(size=(700, 2, 32)).astype(np.float32)
TOKENS = np.arange(700) % 97
Q = RNG.normal(size=(2, 4, 32)).astype(np.float32)


def _filled(prefix=True, offload=False):
    cache = HiSparseCache(CFG, "xla", prefix=PrefixIndex(CFG.page_size) if prefix else None)
    cache.prefill(0, K, V, TOKENS)
    if offload:
        return OffloadedCache(cache)
    return cache


def _refused(cache, call, match):
    """`call` raises ValueError matching `match`; the cache is unchanged, its page
    accounting intact, and it still attends as before."""
    before = cache_snapshot(cache)
    with pytest.raises(ValueError, match=match):
        call()
    assert_same_snapshot(before, cache_snapshot(cache))
    check_page_accounting(cache)


# ---------------------------------------------------------------- corrupted before

@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("call", ["release", "prefill", "prewarm"])
def test_bool_sequence_ids_are_refused(offload, call):
    cache = _filled(offload=offload)
    fn = {"release": lambda: cache.release(True),
          "prefill": lambda: cache.prefill(True, K[:100], V[:100]),
          "prewarm": lambda: cache.prewarm("doc", TOKENS[:100], K[:100], V[:100], seq=True)}
    _refused(cache, fn[call], "seq must be an int")
    cache.prefill(1, K[:300], V[:300])  # slot 1 was empty, slot 0 still live
    with pytest.raises(ValueError, match="already holds 700 tokens"):
        cache.prefill(0, K[:10], V[:10])


def test_numpy_sequence_ids_work():
    cache = _filled()
    cache.prefill(np.int64(1), K[:300], V[:300])
    cache.release(np.int32(1))
    check_page_accounting(cache)


def test_one_prefix_index_serves_one_cache():
    index = PrefixIndex(CFG.page_size)
    a = HiSparseCache(CFG, "xla", prefix=index)
    with pytest.raises(ValueError, match="already serves another cache"):
        HiSparseCache(CFG, "xla", prefix=index)
    a.prefill(0, K, V, TOKENS)
    check_page_accounting(a)
    # An index that already holds entries names pages no new cache wrote.
    loose = PrefixIndex(CFG.page_size)
    loose.insert(np.arange(32), [3, 4])
    with pytest.raises(ValueError, match="only take an empty PrefixIndex"):
        HiSparseCache(CFG, "xla", prefix=loose)
    # A refused construction leaves the index free.
    fresh = PrefixIndex(CFG.page_size)
    with pytest.raises(ValueError, match="page_size"):
        HiSparseCache(CFG.replace(page_size=32), "xla", prefix=fresh)
    HiSparseCache(CFG, "xla", prefix=fresh)


def test_a_bound_index_changes_only_through_its_cache():
    cache = _filled()
    ix = cache.prefix
    _refused(cache, lambda: ix.insert(np.arange(32) + 500, [5, 6]), "belongs to a cache")
    _refused(cache, lambda: ix.acquire(cache.seq_hashes[0][:1]), "belongs to a cache")
    _refused(cache, lambda: ix.release(cache.seq_hashes[0][:1]), "belongs to a cache")
    _refused(cache, lambda: ix.prewarm("x", np.arange(32), [1, 2]), "belongs to a cache")
    # Eviction straight on the index frees the pages in the cache too.
    cache.release(0)
    free = cache.num_free
    assert ix.evict() and cache.num_free > free
    check_page_accounting(cache)
    assert cache.num_free == CFG.pool_pages


@pytest.mark.parametrize("kwargs,match", [
    ({"tokens": None}, "token ids"),
    ({"context_id": "doc"}, "already prewarmed"),
    ({"context_id": ""}, "non-empty str"),
    ({"context_id": 7}, "non-empty str"),
    ({"tokens": TOKENS[:400] + 0.5}, "integer token ids"),
    ({"tokens": TOKENS[:399]}, "399 ids for 400 positions"),
    ({"tokens": TOKENS[:8], "k": K[:8], "v": V[:8]}, "at least one full page"),
    ({"k": np.where(np.arange(400)[:, None, None] == 200, np.nan, K[:400])}, "finite"),
])
def test_failed_prewarm_changes_nothing(kwargs, match):
    cache = HiSparseCache(CFG, "xla", prefix=PrefixIndex(CFG.page_size))
    cache.prewarm("doc", TOKENS[:400], K[:400], V[:400])
    args = {"context_id": "other", "tokens": TOKENS[:400], "k": K[:400], "v": V[:400]} | kwargs
    _refused(cache, lambda: cache.prewarm(**args), match)
    assert not cache.seq_lens.any()  # no orphan sequence


@pytest.mark.parametrize("kwargs,match", [
    ({"working_set": 10.5}, "working_set must be an int"),
    ({"working_set": 0}, "working_set must be an int"),
    ({"working_set": True}, "working_set must be an int"),
    ({"working_set": 3}, "candidate pages"),
    ({"policy": "lru"}, "scheduler.Policy"),
    ({"device_budget": -5}, "device_budget"),
    ({"device_budget": 2.5e9}, "device_budget"),
])
def test_offload_refuses_before_taking_the_cache(kwargs, match):
    cache = _filled()
    out = np.asarray(cache.attend(Q))
    _refused(cache, lambda: OffloadedCache(cache, **kwargs), match)
    off = OffloadedCache(cache, working_set=np.int64(2 * CFG.candidate_pages))
    np.testing.assert_allclose(np.asarray(off.attend(Q)), out, rtol=0, atol=0)


# ---------------------------------------------------------------- accepted silently before

def test_float_token_ids_never_match():
    cache = _filled()
    _refused(cache, lambda: cache.prefill(1, K[:512], V[:512], np.arange(512) + 0.5),
             "integer token ids")
    _refused(cache, lambda: cache.prefill(1, K[:512], V[:512], [True] * 512),
             "integer token ids")
    _refused(cache, lambda: cache.prefill(1, K[:512], V[:512], -np.ones(512, int)), ">= 0")
    with pytest.raises(ValueError, match="integer token ids"):
        cache.prefix.match(np.arange(512) + 0.5)


def test_capacity_planner_shares_the_cache_working_set_rule(capsys):
    for multiple in (0, 0.5):
        with pytest.raises(ValueError, match="working.set"):
            capacity.plan("llama3-8b", 1 << 20, offload=True, working_set_multiple=multiple)
        line = cli_error(capsys, ["capacity", "--offload", "--working-set", str(multiple)])
        assert "--working-set" in line
    with pytest.raises(ValueError, match="working_set must be an int"):
        capacity.plan("llama3-8b", 1 << 20, offload=True, working_set_pages=10)


def _poison(x, token, channel):
    x = x.copy()
    x[token, 1, channel] = np.nan
    return x


@pytest.mark.parametrize("where", ["cold_key", "cold_value", "hot_key", "inf_warm_value"])
def test_non_finite_kv_poisons_its_sequence_only(where, implementation):
    cfg = CFG.replace(budget_tokens=-1)  # every page attended: nothing may be dropped
    clean = HiSparseCache(cfg, implementation)
    bad = HiSparseCache(cfg, implementation)
    k, v = K.copy(), V.copy()
    if where == "cold_key":
        k = _poison(k, 40, 3)
    elif where == "cold_value":
        v = _poison(v, 40, 3)
    elif where == "hot_key":
        k = _poison(k, 690, 0)
    else:
        v[650, 0, 5] = np.inf
    for c, (kk, vv) in ((clean, (K, V)), (bad, (k, v))):
        c.prefill(0, kk, vv)
        c.prefill(1, K[:300], V[:300])
    assert bad.poisoned() == [0] and clean.poisoned() == []
    assert bad.counters()["poisoned_sequences"] == 1
    out, ref = np.asarray(bad.attend(Q)), np.asarray(clean.attend(Q))
    assert np.isnan(out[0]).all()  # the whole sequence, every head: visibly poisoned
    np.testing.assert_array_equal(out[1], ref[1])
    bad.release(0)
    bad.prefill(0, K, V)
    assert bad.poisoned() == []
    assert np.isfinite(np.asarray(bad.attend(Q))).all()


def test_non_finite_append_poisons_and_is_never_shared():
    cache = _filled()
    kk = RNG.normal(size=(2, 2, 32)).astype(np.float32)
    kk[1] = np.nan  # slot 1 is empty: its row is ignored
    cache.append(kk, kk)
    assert cache.poisoned() == []
    kk[0, 0, 0] = np.inf
    cache.append(kk, kk)
    assert cache.poisoned() == [0]
    # A poisoned prefill registers nothing in the prefix index.
    entries = len(cache.prefix)
    cache.prefill(1, _poison(K, 100, 2), V, TOKENS + 1)
    assert cache.poisoned() == [0, 1] and len(cache.prefix) == entries
    check_page_accounting(cache)


def test_append_defaults_to_live_sequences():
    cache = _filled()
    x = RNG.normal(size=(2, 2, 32)).astype(np.float32)
    cache.append(x, x)
    assert cache.seq_lens.tolist() == [701, 0]
    cache.prefill(1, K[:50], V[:50])  # slot 1 is still empty and takes a prefill
    _refused(cache, lambda: cache.append(x, x, active=["no", "no"]), "bool array")
    _refused(cache, lambda: cache.append(x, x, active=[2, 0]), "bool array")
    _refused(cache, lambda: cache.append(x, x, active=[True]), r"shape \(2,\)")
    cache.release(1)
    _refused(cache, lambda: cache.append(x, x, active=[True, True]), r"empty sequences \[1\]")
    cache.append(x, x, active=np.array([1, 0]))
    assert cache.seq_lens.tolist() == [702, 0]


@pytest.mark.parametrize("pages,match", [
    (np.full((2, 2, 4), 5.0), "integer"),
    (np.full((2, 2, 4), 0), "not a cold page"),        # the sink page
    (np.full((2, 2, 4), 40), "not a cold page"),       # a warm page
    (np.full((2, 2, 4), 900), "not a cold page"),      # past the context
    (np.full((2, 2, 4), 30), "sequence 1"),            # slot 1 is empty
    (np.full((2, 4), 5), r"\[2, 2, K\]"),
])
def test_prefetch_checks_page_ids(pages, match):
    off = _filled(offload=True)
    off.attend(Q)
    if match == "sequence 1":
        pages = pages.copy()
        pages[0] = -1
    _refused(off, lambda: off.prefetch(pages), match)
    ok = np.full((2, 2, 4), -1)
    ok[0, :, 0] = 5
    off.prefetch(ok)


@pytest.mark.parametrize("field,value,match", [
    ("num_kv_heads", True, "positive int"),
    ("max_seqs", False, "positive int"),
    ("head_dim", 64.0, "positive int"),
    ("num_kv_heads", 0, "positive int"),
    ("budget_tokens", True, "multiple of page_size"),
    ("bound_share", True, "number"),
    ("tail_sample_pages", 1.5, "non-negative int"),
])
def test_config_refuses_bools_and_floats_for_ints(field, value, match):
    with pytest.raises(ValueError, match=match):
        CFG.replace(**{field: value})


def test_config_takes_numpy_numbers_as_python_ones():
    cfg = CFG.replace(max_seqs=np.int64(3), bound_share=np.float32(0.25))
    assert type(cfg.max_seqs) is int and cfg.max_seqs == 3
    assert type(cfg.bound_share) is float and cfg == CFG.replace(max_seqs=3, bound_share=0.25)


def test_scheduler_and_pressure_inputs():
    with pytest.raises(ValueError, match="Policy.kind"):
        scheduler.Policy(kind="fifo")
    with pytest.raises(ValueError, match="Policy.decay"):
        scheduler.Policy(decay="high")
    with pytest.raises(ValueError, match="Policy.max_prefetch"):
        scheduler.Policy(max_prefetch=True)
    with pytest.raises(ValueError, match="policy must be"):
        scheduler.init_state(1, 2, 8, "lru")
    with pytest.raises(ValueError, match="working_set"):
        scheduler.init_state(1, 2, 8.0)
    s = scheduler.init_state(1, 2, 8)
    with pytest.raises(ValueError, match="integer logical page ids"):
        scheduler.plan(s, np.zeros((1, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"\[1, 2, K\]"):
        scheduler.plan(s, np.zeros((2, 2, 4), np.int32))
    with pytest.raises(ValueError, match="seq must be"):
        scheduler.forget_sequence(s, True)
    with pytest.raises(ValueError, match="working_set"):
        scheduler.resize(s, 0)
    with pytest.raises(ValueError, match="HiSparseConfig"):
        pressure.levels("default")


def test_cache_inputs_that_are_not_arrays():
    cache = _filled()
    _refused(cache, lambda: cache.prefill(1, "keys", V[:10]), "shape|array")
    _refused(cache, lambda: cache.prefill(1, K[:10].astype(np.float64), V[:10]), "float16")
    _refused(cache, lambda: cache.prefill(1, K[:0], V[:0]), "at least one token")
    _refused(cache, lambda: cache.prefill(1, K[:10, :1], V[:10, :1]), "shape")
    _refused(cache, lambda: cache.attend(Q[:, :2]), "shape")
    _refused(cache, lambda: cache.attend(Q.astype(np.int32)), "float16")
    with pytest.raises(ValueError, match="HiSparseConfig"):
        HiSparseCache({"num_kv_heads": 2})
    with pytest.raises(ValueError, match="PrefixIndex"):
        HiSparseCache(CFG, prefix="yes")
