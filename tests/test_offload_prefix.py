"""Offload mode with everything else the cache does: prefix sharing, prewarm,
prefill and release after offloading, eviction of unused prefixes. Every step's
output must equal an all-resident cache given the same calls, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from hisparse_jax.cache.handle import CacheFullError, HiSparseCache
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.offload.store import OffloadedCache

CFG = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=4096, max_seqs=3,
                     budget_tokens=256, num_pool_pages=320)


def _kv_for(tokens):
    """K/V as a function of (token, position): equal prefixes give equal K/V."""
    t = np.asarray(tokens, np.int64)[:, None, None]
    pos = np.arange(len(tokens))[:, None, None]
    ch = np.arange(1, 2 * 64 + 1).reshape(1, 2, 64)
    return (2 * np.sin((t * 0.37 + pos * 0.011) * ch * 0.13).astype(np.float32),
            np.cos((t * 0.53 + pos * 0.007) * ch * 0.07).astype(np.float32))


class Pair:
    """The same calls on an offloaded cache and on an all-resident one."""

    def __init__(self, offload_after_prewarm: bool):
        self.ref = HiSparseCache(CFG, implementation="xla", prefix=PrefixIndex(CFG.page_size))
        self.raw = HiSparseCache(CFG, implementation="xla", prefix=PrefixIndex(CFG.page_size))
        self.doc = np.random.default_rng(0).integers(0, 50000, 1500)
        self.off = None if offload_after_prewarm else OffloadedCache(self.raw)
        for c in self.caches():
            c.prewarm("doc", self.doc, *_kv_for(self.doc))
        if self.off is None:
            self.off = OffloadedCache(self.raw)
        self.tokens: dict[int, list] = {}

    def caches(self):
        return [self.ref, self.off or self.raw]

    def prefill(self, seq, toks):
        for c in self.caches():
            c.prefill(seq, *_kv_for(toks), tokens=toks)
        self.tokens[seq] = list(toks)

    def append(self, rng):
        active = self.ref.seq_lens > 0
        kk = np.zeros((3, 2, 64), np.float32)
        vv = np.zeros_like(kk)
        for s in np.flatnonzero(active):
            self.tokens[s].append(int(rng.integers(0, 50000)))
            k, v = _kv_for(self.tokens[s])
            kk[s], vv[s] = k[-1], v[-1]
        for c in self.caches():
            c.append(kk, vv, active=active)

    def release(self, seq):
        for c in self.caches():
            c.release(seq)
        self.tokens.pop(seq)

    def check(self, rng):
        q = rng.normal(size=(3, CFG.num_q_heads, 64)).astype(np.float32)
        out, ref = np.asarray(self.off.attend(q)), np.asarray(self.ref.attend(q))
        for s in self.tokens:
            np.testing.assert_array_equal(out[s], ref[s])
        np.testing.assert_array_equal(np.asarray(self.off.state.page_table),
                                      np.asarray(self.ref.state.page_table))
        assert self.off.cache.num_free == self.ref.num_free


@pytest.mark.parametrize("offload_after_prewarm", [True, False])
def test_offload_with_prefix_sharing_prefill_and_release(offload_after_prewarm):
    rng = np.random.default_rng(1)
    pair = Pair(offload_after_prewarm)
    doc = pair.doc
    pair.prefill(0, np.concatenate([doc, rng.integers(0, 50000, 300)]))
    free = pair.off.cache.num_free
    pair.prefill(1, np.concatenate([doc, rng.integers(0, 50000, 700)]))
    # the shared document is stored once: seq 1 only adds its own pages
    assert free - pair.off.cache.num_free < 700 // CFG.page_size + 2
    assert pair.off.counters()["prefix_hits"] > 0
    for step in range(20):
        pair.append(rng)
        pair.check(rng)
        if step == 6:
            pair.release(0)  # its working set is forgotten; shared pages stay
        if step == 9:        # a new sequence in the released slot: no stale residents
            pair.prefill(0, rng.integers(0, 50000, 1900))
    # Pool pressure: the pinned document is evicted only once unpinned.
    with pytest.raises(CacheFullError):
        for c in pair.caches():
            c.prefill(2, *_kv_for(rng.integers(0, 50000, 4000)))
    for c in pair.caches():
        c.prefix.unpin("doc")
    pair.release(1)
    pair.prefill(2, rng.integers(0, 50000, 3900))  # needs the document's pages
    assert pair.off.counters()["prefix_evictions"] > 0
    pair.append(rng)
    pair.check(rng)


def test_offloading_twice_is_refused():
    off = OffloadedCache(HiSparseCache(CFG, implementation="xla"))
    with pytest.raises(ValueError, match="already offloaded"):
        OffloadedCache(off.cache)


def test_cold_pages_live_in_host_memory():
    cache = HiSparseCache(CFG, implementation="xla")
    x = np.random.default_rng(3).normal(size=(3000, 2, 64)).astype(np.float32)
    cache.prefill(0, x, x)
    before = {f: np.asarray(getattr(cache.state, f)) for f in ("int4_k", "int4_v_scale")}
    off = OffloadedCache(cache)
    kinds = {m.kind for m in off.state.int4_k.devices().pop().addressable_memories()}
    assert off.memory_kind == ("pinned_host" if "pinned_host" in kinds else "unpinned_host")
    for f, arr in off.host.items():
        assert arr.sharding.memory_kind == off.memory_kind
        assert getattr(off.state, f).shape[1] == 0  # no cold codes left on the device
        assert off.ws[f].sharding.memory_kind == "device"
    for f, arr in before.items():  # moved, not changed
        np.testing.assert_array_equal(np.asarray(off.host[f]), arr)


def test_layer_ahead_prefetch_raises_hits_and_keeps_outputs_exact():
    """Two layers over one workload: the layer below's selection, handed to the next
    layer's `prefetch` before it attends, turns misses into hits; outputs stay equal
    to an all-resident cache, and the last step's selection is never evicted."""
    from hisparse_jax.config import preset
    from hisparse_jax.harness.workloads import make_workload
    from hisparse_jax.offload import policy as scheduler
    wl = make_workload(context=4096, num_kv_heads=2, num_queries=4, seed=3)
    cfg = preset("default").replace(num_kv_heads=2, max_context=4096, budget_tokens=256)
    rng = np.random.default_rng(0)
    q = np.asarray(wl.q)
    jitter = 0.15 * np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(q.shape[-1])
    steps = [q[t // 6] + jitter[t // 6] * rng.standard_normal(q.shape[1:]) for t in range(24)]
    upper = [s + jitter[t // 6] * rng.standard_normal(s.shape) for t, s in enumerate(steps)]

    def layer(policy):
        c = HiSparseCache(cfg, implementation="xla")
        c.prefill(0, wl.k, wl.v)
        return OffloadedCache(c, policy=policy)

    hit_rates = {}
    for name, policy, ahead in (("plain", scheduler.Policy(), False),
                                ("ahead", scheduler.Policy(), True),
                                ("lru", scheduler.LRU, True)):
        below, above = layer(policy), layer(policy)
        ref = HiSparseCache(cfg, implementation="xla")  # remembers its own last step
        ref.prefill(0, wl.k, wl.v)
        last = None
        for s, u in zip(steps, upper):
            _, sel = below.attend(s[None].astype(np.float32), return_selection=True)
            # The attended pages are a subset of the candidates the layer kept resident.
            cand = np.asarray(below.candidates)
            for h in range(2):
                assert set(np.asarray(sel)[0, h]) - {-1} <= set(cand[0, h])
            if ahead:
                above.prefetch(below.candidates)
                if last is not None:  # the last step's selection stayed resident
                    res = np.asarray(above.sched.resident)
                    for h in range(2):
                        assert set(last[0, h][last[0, h] >= 0]) <= set(res[0, h])
            out, last = above.attend(u[None].astype(np.float32), return_selection=True)
            last = np.asarray(last)
            np.testing.assert_array_equal(np.asarray(out),
                                          np.asarray(ref.attend(u[None].astype(np.float32))))
        hit_rates[name] = above.counters()["hit_rate"]
        if name == "lru":
            assert above.counters()["prefetched"] == 0
    print(hit_rates)
    assert hit_rates["ahead"] > hit_rates["plain"] + 0.02, hit_rates
    with pytest.raises(ValueError, match="pages must be"):
        above.prefetch(np.zeros((3, 2), np.int32))


OPS = hs.lists(hs.tuples(hs.sampled_from(["prefill", "append", "release", "prewarm", "evict"]),
                         hs.integers(0, 2), hs.integers(0, 2), hs.integers(300, 1800)),
               min_size=3, max_size=9)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS, hs.integers(0, 9))
def test_random_interleavings_with_offload(ops, offload_at):
    """Append, release, prewarm, eviction and an offload at any point: page
    accounting never leaks or aliases, the host pool holds every live cold page's
    bytes, and outputs equal an all-resident twin given the same calls."""
    cfg = CFG.replace(max_context=2048, num_pool_pages=200)
    twin = HiSparseCache(cfg, implementation="xla", prefix=PrefixIndex(cfg.page_size))
    cache = HiSparseCache(cfg, implementation="xla", prefix=PrefixIndex(cfg.page_size))
    handle = cache
    bases = [np.random.default_rng(s).integers(0, 50000, 2048) for s in range(3)]
    tokens: dict[int, list] = {}
    for i, (op, seq, base, n) in enumerate(ops + [("end", 0, 0, 0)]):
        if i >= min(offload_at, len(ops)) and handle is cache:
            handle = OffloadedCache(cache)
        calls = []
        if op == "prefill" and twin.seq_lens[seq] == 0:
            toks = bases[base][:n].copy()
            toks[n // 2:] += seq + 1  # sequences diverge half way
            calls = [lambda c, s=seq, t=toks: c.prefill(s, *_kv_for(t), tokens=t)]
            new_tokens = {seq: list(toks)}
        elif op == "append" and twin.seq_lens.any():
            active = twin.seq_lens > 0
            new_tokens = {s: tokens[s] + [int(bases[base][-1 - s])] for s in np.flatnonzero(active)}
            kk = np.zeros((3, 2, 64), np.float32)
            vv = np.zeros_like(kk)
            for s, t in new_tokens.items():
                k, v = _kv_for(t)
                kk[s], vv[s] = k[-1], v[-1]
            calls = [lambda c, k=kk, v=vv, a=active: c.append(k, v, active=a)]
        elif op == "release" and twin.seq_lens[seq]:
            calls = [lambda c, s=seq: c.release(s)]
            new_tokens = {}
            tokens.pop(seq)
        elif op == "prewarm" and (twin.seq_lens == 0).any() and f"d{base}-{n}" not in twin.prefix.contexts:
            doc = bases[base][:n]
            calls = [lambda c, d=doc, name=f"d{base}-{n}": c.prewarm(name, d, *_kv_for(d))]
            new_tokens = {}
        elif op == "evict":
            def evict(c):
                for ctx in list(c.prefix.contexts):
                    c.prefix.unpin(ctx)
                inner = getattr(c, "cache", c)
                inner._make_room(inner.num_free + 1 if inner.num_free < cfg.pool_pages else 0)
            calls = [evict]
            new_tokens = {}
        for call in calls:
            outcomes = []
            for c in (twin, handle):
                try:
                    call(c)
                    outcomes.append(True)
                except CacheFullError:
                    outcomes.append(False)
            assert outcomes[0] == outcomes[1]
            if outcomes[0]:
                tokens.update(new_tokens)
        st = cache.state
        np.testing.assert_array_equal(np.asarray(st.page_table), np.asarray(twin.state.page_table))
        np.testing.assert_array_equal(np.asarray(st.refcount), np.asarray(twin.state.refcount))
        nfree = int(st.num_free)
        assert nfree == cache.num_free == twin.num_free
        free = set(np.asarray(st.free_pages)[:nfree].tolist())
        assert len(free) == nfree and not free & set(np.flatnonzero(np.asarray(st.refcount)))
    assert handle is not cache
    used = np.flatnonzero(np.asarray(twin.state.refcount))  # their codes are on the host
    for f, arr in handle.host.items():
        np.testing.assert_array_equal(np.asarray(arr)[:, used],
                                      np.asarray(getattr(twin.state, f))[:, used])
    q = np.random.default_rng(9).normal(size=(3, cfg.num_q_heads, 64)).astype(np.float32)
    out, ref = np.asarray(handle.attend(q)), np.asarray(twin.attend(q))
    for s in tokens:
        np.testing.assert_array_equal(out[s], ref[s])
