"""Property-based harness (hypothesis): random sequences of valid and invalid calls
against a HiSparseCache with a prefix index, and a twin that receives only the
valid ones. After every call: the two are bit-equal (device state, host mirrors,
prefix index), their attention outputs are bit-equal, and page accounting holds
(no leak, no aliasing, num_free equal to the device's). Invalid calls must raise
ValueError and change nothing.

Derandomized (a fixed seed), so CI runs the same calls every time; the number of
calls it made is printed at the end of the run."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hisparse_jax.cache.handle import CacheFullError, HiSparseCache
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.offload.store import OffloadedCache
from tests.helpers import assert_same_snapshot, cache_snapshot, check_page_accounting

CFG = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=32, page_size=16, max_context=512,
                     max_seqs=3, sink_tokens=16, hot_tokens=32, warm_tokens=32,
                     budget_tokens=64, value_group=16, num_pool_pages=40)
LENGTHS = (17, 100, 250, 512)  # few distinct prefill shapes: each one compiles once
RNG = np.random.default_rng(2026)
# Documents: K/V are a function of the token ids, so equal prefixes are equal caches.
DOCS = [RNG.integers(0, 5000, 512) for _ in range(3)]
DOCS[1][:200] = DOCS[0][:200]  # doc 1 shares a 200-token prefix with doc 0
TABLE_K = RNG.normal(size=(5000, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32)
TABLE_V = RNG.normal(size=(5000, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32)
CALLS = {"valid": 0, "invalid": 0, "refused_valid": 0}


def _kv(tokens):
    return TABLE_K[tokens], TABLE_V[tokens]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.real = HiSparseCache(CFG, "xla", prefix=PrefixIndex(CFG.page_size))
        self.twin = HiSparseCache(CFG, "xla", prefix=PrefixIndex(CFG.page_size))
        self.contexts = set()

    def _both(self, fn):
        """A valid call on both caches: the same result, or the same refusal."""
        CALLS["valid"] += 1
        outcomes = []
        for cache in (self.real, self.twin):
            try:
                outcomes.append(("ok", fn(cache)))
            except (ValueError, CacheFullError) as e:
                outcomes.append((type(e), str(e)))
        assert outcomes[0][0] == outcomes[1][0], outcomes
        if outcomes[0][0] != "ok":
            CALLS["refused_valid"] += 1
        return outcomes

    def _invalid(self, fn):
        """An invalid call on the real cache only: ValueError, nothing changed."""
        CALLS["invalid"] += 1
        before = cache_snapshot(self.real)
        with pytest.raises(ValueError):
            fn(self.real)
        assert_same_snapshot(before, cache_snapshot(self.real))

    # ------------------------------------------------------------ valid calls
    @rule(seq=hs.integers(0, CFG.max_seqs - 1), doc=hs.integers(0, 2),
          length=hs.sampled_from(LENGTHS), with_tokens=hs.booleans())
    def prefill(self, seq, doc, length, with_tokens):
        tokens = DOCS[doc][:length]
        k, v = _kv(tokens)
        self._both(lambda c: c.prefill(seq, k, v, tokens if with_tokens else None))

    @rule(data=hs.data())
    def append(self, data):
        live = np.flatnonzero(self.twin.seq_lens > 0).tolist()
        active = np.zeros(CFG.max_seqs, bool)
        if live:
            active[data.draw(hs.lists(hs.sampled_from(live), unique=True))] = True
        tok = data.draw(hs.integers(0, 4999))
        k = np.broadcast_to(TABLE_K[tok], (CFG.max_seqs, *TABLE_K.shape[1:])).copy()
        v = np.broadcast_to(TABLE_V[tok], (CFG.max_seqs, *TABLE_V.shape[1:])).copy()
        use_default = data.draw(hs.booleans())
        if use_default:  # every live sequence
            active = self.twin.seq_lens > 0
        k[~active] = np.nan  # rows of inactive slots are ignored, whatever they hold
        self._both(lambda c: c.append(k, v, None if use_default else active))

    @rule(seed=hs.integers(0, 2**16))
    def attend(self, seed):
        q = np.random.default_rng(seed).normal(
            size=(CFG.max_seqs, CFG.num_q_heads, CFG.head_dim)).astype(np.float32)
        (kind, out), (_, twin_out) = self._both(lambda c: np.asarray(c.attend(q)))
        assert kind == "ok"
        np.testing.assert_array_equal(out, twin_out)
        assert np.isfinite(out[self.twin.seq_lens > 0]).all()

    @rule(seq=hs.integers(0, CFG.max_seqs - 1))
    def release(self, seq):
        self._both(lambda c: c.release(seq))

    @rule(name=hs.sampled_from(["a", "b"]), doc=hs.integers(0, 2),
          length=hs.sampled_from(LENGTHS[1:]))
    def prewarm(self, name, doc, length):
        tokens = DOCS[doc][:length]
        k, v = _kv(tokens)
        if self._both(lambda c: c.prewarm(name, tokens, k, v))[0][0] == "ok":
            self.contexts.add(name)

    @precondition(lambda self: self.contexts)
    @rule(data=hs.data())
    def unpin(self, data):
        name = data.draw(hs.sampled_from(sorted(self.contexts)))
        self._both(lambda c: c.prefix.unpin(name))
        self.contexts.discard(name)

    @rule(n=hs.integers(0, 3))
    def evict(self, n):
        self._both(lambda c: c.prefix.evict(n))

    # ------------------------------------------------------------ invalid calls
    @rule(data=hs.data())
    def invalid(self, data):
        empty = np.flatnonzero(self.twin.seq_lens == 0)
        live = np.flatnonzero(self.twin.seq_lens > 0)
        tokens = DOCS[0][:100]
        k, v = _kv(tokens)
        x = np.zeros((CFG.max_seqs, CFG.num_kv_heads, CFG.head_dim), np.float32)
        q = np.zeros((CFG.max_seqs, CFG.num_q_heads, CFG.head_dim), np.float32)
        calls = [
            lambda c: c.release(True),
            lambda c: c.release(-1),
            lambda c: c.release(CFG.max_seqs),
            lambda c: c.release(1.0),
            lambda c: c.prefill(False, k, v),
            lambda c: c.prefill(int(empty[0]) if empty.size else 0, k, v, tokens + 0.5),
            lambda c: c.prefill(int(empty[0]) if empty.size else 0, k, v, tokens[:-1]),
            lambda c: c.prefill(int(empty[0]) if empty.size else 0, k.astype(np.float64), v),
            lambda c: c.prefill(int(empty[0]) if empty.size else 0, k[:, :1], v[:, :1]),
            lambda c: c.prefill(0, np.zeros((600, 2, 32), np.float32),
                                np.zeros((600, 2, 32), np.float32)),  # past max_context
            lambda c: c.append(x, x, active=["no"] * CFG.max_seqs),
            lambda c: c.append(x[:1], x[:1]),
            lambda c: c.append(x, x, active=np.isin(np.arange(CFG.max_seqs), empty[:1])
                               if empty.size else "all"),
            lambda c: c.attend(q[:, :1]),
            lambda c: c.attend(q.astype(np.int8)),
            lambda c: c.prewarm("", tokens, k, v),
            lambda c: c.prewarm("c", None, k, v),
            lambda c: c.prewarm("c", tokens[:5], k[:5], v[:5]),
            lambda c: c.prewarm(min(self.contexts) if self.contexts else 3, tokens, k, v),
            lambda c: c.prefix.insert(tokens, list(range(6))),
            lambda c: c.prefix.evict(-1),
            lambda c: c.prefix.unpin("never"),
            lambda c: OffloadedCache(c, working_set=10.5),
            lambda c: OffloadedCache(c, working_set=0),
            lambda c: OffloadedCache(c, policy="lru"),
        ]
        if live.size:
            calls.append(lambda c: c.prefill(int(live[0]), k, v))  # not empty
        self._invalid(data.draw(hs.sampled_from(calls)))

    # ------------------------------------------------------------ after every call
    @invariant()
    def twins_agree_and_pages_add_up(self):
        assert_same_snapshot(cache_snapshot(self.real), cache_snapshot(self.twin))
        check_page_accounting(self.real)
        check_page_accounting(self.twin)


CacheMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=30, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestCacheMachine = CacheMachine.TestCase


def teardown_module():
    print(f"\nhypothesis harness: {CALLS['valid']} valid calls ({CALLS['refused_valid']} "
          f"refused by the state, on both caches alike), {CALLS['invalid']} invalid calls")
