"""Offload residency scheduler: plan/apply invariants, counters, policy vs LRU."""

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache import layout
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness import traces
from hisparse_jax.offload import policy as sc


def _run_checked(policy, sel, cand=None, prev=None, W=32):
    s = sc.init_state(sel.shape[1], sel.shape[2], W, policy)
    tot = np.zeros(len(sc.COUNTERS), np.int64)
    for t in range(sel.shape[0]):
        before = np.asarray(s.resident)
        nxt_prev = None if prev is None or t + 1 >= len(prev) else jnp.asarray(prev[t + 1])
        p = sc.plan(s, jnp.asarray(sel[t]), nxt_prev,
                    None if cand is None else jnp.asarray(cand[t]))
        s = sc.apply(s, p)
        res = np.asarray(s.resident)
        fetch, evict, hit = np.asarray(p.fetch), np.asarray(p.evict), np.asarray(p.hit)
        d = dict(zip(sc.COUNTERS, np.asarray(p.delta)))
        for b in range(sel.shape[1]):
            for h in range(sel.shape[2]):
                r = res[b, h]
                live = r[r >= 0]
                assert len(live) == len(set(live)) <= W          # no duplicates, <= W
                want = set(sel[t, b, h][sel[t, b, h] >= 0])
                assert want <= set(live)                          # every selected page resident
                old = set(before[b, h][before[b, h] >= 0])
                # hits are exactly the selected pages that were resident before
                assert set(sel[t, b, h][hit[b, h]]) == want & old
                f = fetch[b, h][fetch[b, h] >= 0]
                e = evict[b, h][evict[b, h] >= 0]
                assert set(live) == (old - set(e)) | set(f)     # slots: old - evicted + fetched
                assert not (set(f) & old) and set(e) <= old
                # fetched pages sit in the slots the plan names
                assert all(r[w] == fetch[b, h, w] for w in np.flatnonzero(fetch[b, h] >= 0))
        assert d["hits"] + d["misses"] == d["selected"]
        assert d["fetched"] == d["misses"] + d["prefetched"]
        assert d["fetched"] == (fetch >= 0).sum() and d["evictions"] == (evict >= 0).sum()
        tot += np.asarray(p.delta)
    assert np.array_equal(tot, np.asarray(s.counters))
    assert int(s.step) == sel.shape[0]
    return s


@pytest.mark.parametrize("policy", [sc.LRU, sc.Policy(), sc.Policy(prefetch_candidates=True),
                                    sc.Policy(max_prefetch=0)])
def test_plan_apply_invariants(policy):
    sel, cand = traces.synthetic_trace(steps=24, num_pages=200, k=16, heads=2, seed=1)
    sel = np.concatenate([sel, sel[:, :, ::-1]], axis=1)  # batch of 2 sequences
    cand = np.concatenate([cand, cand[:, :, ::-1]], axis=1)
    sel[3, 0, 0, 5:] = -1                                  # fewer than K pages
    sel[4, 1, 1, 1] = sel[4, 1, 1, 0]                      # a repeated page counts once
    prev = np.roll(sel, -1, axis=-1)
    s = _run_checked(policy, sel, cand, prev, W=32)
    c = sc.counters(s, HiSparseConfig())
    assert c["host_to_device_bytes"] == c["fetched"] * sc.page_bytes(HiSparseConfig())
    if policy.kind == "lru":
        assert c["prefetched"] == 0


def test_working_set_equal_to_budget_and_errors():
    sel, _ = traces.synthetic_trace(steps=8, num_pages=100, k=16, heads=1)
    _run_checked(sc.Policy(), sel, W=16)  # W == K: everything but the selection goes
    with pytest.raises(ValueError):
        sc.plan(sc.init_state(1, 1, 8), jnp.asarray(sel[0]))
    with pytest.raises(ValueError):
        sc.Policy(kind="mru")


def test_working_set_bytes_counts_every_array():
    cfg = HiSparseConfig(num_kv_heads=2, max_context=4096)
    W = 24
    s = sc.init_state(3, cfg.num_kv_heads, W)
    # resident page data and the tail-sample buffer, all heads
    data = 3 * (W + cfg.sample_pages) * layout.per_page_cold_bytes(cfg)[0]
    assert sc.working_set_bytes(cfg, W, batch=3) == data + layout.nbytes(s)


def test_policy_beats_lru_on_drifting_trace():
    sel, cand = traces.synthetic_trace(steps=64, num_pages=512, k=16, heads=2, drift=2, seed=3)
    out = {}
    for name, pol in (("lru", sc.LRU), ("pred", sc.Policy(prefetch_candidates=True))):
        s, hits = sc.run_trace(sc.init_state(1, 2, 32, pol), jnp.asarray(sel), None,
                               jnp.asarray(cand))
        out[name] = sc.counters(s)["hit_rate"]
        assert int(jnp.sum(hits)) == sc.counters(s)["hits"]
    assert out["pred"] > out["lru"] + 0.05, out


def test_real_trace_small():
    """Real selections (select_pages over a workload cache): policy >= LRU at 2x."""
    tr = traces.make_trace("drift", context=4096, steps=48, segment=16, num_kv_heads=2)
    K = tr.selected.shape[-1]
    assert tr.selected.shape == (48, 1, 2, K) and tr.info["overlap_consecutive_steps"] > 0.3
    lru = traces.evaluate(tr, 2 * K, sc.LRU)
    pred = traces.evaluate(tr, 2 * K, sc.Policy())
    assert pred["hit_rate"] >= lru["hit_rate"]
    assert lru["hits"] + lru["misses"] == lru["selected"] == pred["selected"]


def test_bench_cli_small(capsys):
    import json
    import shlex

    from hisparse_jax.cli import main
    argv = ["bench", "scheduler", "--context", "4096", "--steps", "24", "--traces",
            "retrieval, drift", "--multiples", "2", "--max-prefetch", "8,32", "--oracle",
            "--json"]
    main(argv)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # every row (the oracle's too) carries the command, quoted so that it runs again
    assert all(shlex.split(r["command"]) == ["hisparse", *argv] for r in rows)
    assert {r["policy"] for r in rows} >= {"lru", "predictive", "predictive-pf8"}
    assert {r["working_set_multiple"] for r in rows} == {2}
    assert {r["trace"] for r in rows} == {"retrieval", "drift"}
    for r in rows:
        if r["policy"] == "belady-oracle-no-prefetch":
            continue
        assert r["hits"] + r["misses"] == r["selected"] > 0
        assert r["h2d_bytes_per_step"] == r["fetched"] * r["host_to_device_bytes"] \
            / max(1, r["fetched"]) / 24


def test_belady_bound():
    sel, _ = traces.synthetic_trace(steps=40, num_pages=300, k=16, heads=2, seed=5)
    s, _ = sc.run_trace(sc.init_state(1, 2, 32, sc.LRU), jnp.asarray(sel))
    lru = sc.counters(s)["hit_rate"]
    assert traces.belady_hit_rate(sel, 32) >= lru
    s, _ = sc.run_trace(sc.init_state(1, 2, 16, sc.LRU), jnp.asarray(sel))
    assert traces.belady_hit_rate(sel, 16) == pytest.approx(sc.counters(s)["hit_rate"])
