"""Memory pressure: the hot/warm boundary moves (state.retier), the working set
resizes (scheduler.resize), and an offloaded cache fits a device budget by the
least degraded level (pressure.levels) or refuses, changing nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache import pressure
from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig, preset
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.offload.store import OffloadedCache

TIER_FIELDS = ("bf16_k", "bf16_v", "fp8_k", "fp8_v", "fp8_k_scale", "fp8_v_scale")


def _levels(cfg):
    return [(c.hot_tokens, c.warm_tokens, c.budget_tokens) for c in pressure.levels(cfg)]


def test_levels_shrink_hot_first_then_halve_budget():
    assert _levels(preset("default")) == [(128, 384, 2048), (64, 448, 2048), (64, 448, 1024),
                                          (64, 448, 512)]
    assert _levels(preset("tight")) == [(64, 384, 1024), (64, 384, 512)]
    assert _levels(preset("page64")) == [(128, 384, 2048), (64, 448, 2048), (64, 448, 1024),
                                         (64, 448, 512)]
    full = preset("default", budget_tokens=FULL_BUDGET)
    assert _levels(full) == [(128, 384, -1), (64, 448, -1)]
    for c in pressure.levels(preset("page32")):  # every level is a valid config
        assert c.budget_tokens % c.page_size == 0 and c.hot_tokens % c.page_size == 0


def _bf16_exact(rng, n, cfg):
    """K/V whose values are bf16 already: prefill (which encodes fp8 from its source)
    and appends (which encode from bf16) then store the same codes."""
    shape = (n, cfg.num_kv_heads, cfg.head_dim)
    return [rng.normal(size=shape).astype(jnp.bfloat16).astype(np.float32) for _ in "kv"]


def _fill(cfg, kvs, lengths, appends):
    cache = HiSparseCache(cfg, implementation="xla")
    for b, (k, v) in enumerate(kvs):
        if lengths[b]:
            cache.prefill(b, k[:lengths[b]], v[:lengths[b]])
    for t in range(appends):
        cache.append(np.stack([k[lengths[b] + t] for b, (k, _) in enumerate(kvs)]),
                     np.stack([v[lengths[b] + t] for b, (_, v) in enumerate(kvs)]))
    return cache


@pytest.mark.parametrize("page,gqa,lengths,appends", [
    (16, 4, (700, 33, 1500), 0),      # mid-page, inside sink+hot, long
    (16, 1, (129, 515, 2000), 37),    # appends cross page boundaries after the prefill
    (32, 8, (64, 1999, 1), 45),       # a one-token sequence; page 32
])
def test_retier_equals_a_cache_run_under_the_new_tiers(page, gqa, lengths, appends):
    old = HiSparseConfig(num_kv_heads=2, head_dim=64, gqa_group=gqa, page_size=page,
                         sink_tokens=page, hot_tokens=128, warm_tokens=256,
                         budget_tokens=8 * page, max_context=2560, max_seqs=3)
    new = pressure.levels(old)[1]
    st.check_retier(old, new)
    rng = np.random.default_rng(page + gqa)
    kvs = [_bf16_exact(rng, n + appends, old) for n in lengths]
    a, b = _fill(old, kvs, lengths, appends), _fill(new, kvs, lengths, appends)
    moved = st.retier(old, new, a.state)
    bf16_pos, fp8_pos = (np.asarray(p) for p in st.slot_positions(new, moved.seq_lens))
    for f in TIER_FIELDS:  # live slots equal bit for bit (dead slots are never read)
        live = bf16_pos if f.startswith("bf16") else fp8_pos
        x, y = (np.moveaxis(np.asarray(getattr(s, f)).astype(np.float32), 1, 2)[live >= 0]
                for s in (moved, b.state))
        np.testing.assert_array_equal(x, y, err_msg=f)
    for f in ("int4_k", "digest_center", "page_table", "seq_lens"):  # untouched
        assert getattr(moved, f) is getattr(a.state, f) or np.array_equal(
            np.asarray(getattr(moved, f)), np.asarray(getattr(a.state, f)))
    # Decoding goes on under the new tiers with the same results.
    a.cfg, a.state = new, moved
    for t in range(page + 3):  # crosses one page boundary
        k, v = (rng.normal(size=(3, 2, 64)).astype(jnp.bfloat16).astype(np.float32)
                for _ in "kv")
        a.append(k, v)
        b.append(k, v)
        q = rng.normal(size=(3, new.num_q_heads, 64)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(a.attend(q)), np.asarray(b.attend(q)))


def test_retier_refuses_what_it_cannot_do():
    old = preset("default")
    with pytest.raises(ValueError, match="shrinks the hot window"):
        st.check_retier(old.replace(hot_tokens=64, warm_tokens=448), old)
    with pytest.raises(ValueError, match="cold boundary"):
        st.check_retier(old, old.replace(hot_tokens=64))
    with pytest.raises(ValueError, match="only"):
        st.check_retier(old, old.replace(hot_tokens=64, warm_tokens=448, page_size=32))


def test_resize_keeps_the_last_selection_first():
    s = scheduler.init_state(1, 2, 8)
    for pages in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [4, 5, 8, 9]):
        s, _ = scheduler.step(s, jnp.asarray(pages, jnp.int32).reshape(1, 1, 4).repeat(2, 1))
    small, src = scheduler.resize(s, 4)
    assert sorted(np.asarray(small.resident)[0, 0].tolist()) == [4, 5, 8, 9]
    res = np.asarray(s.resident)
    np.testing.assert_array_equal(np.take_along_axis(res, np.asarray(src), -1),
                                  np.asarray(small.resident))
    big, src = scheduler.resize(small, 6)  # relief: new slots start empty
    assert (np.asarray(big.resident)[..., 4:] == -1).all() and (np.asarray(src)[..., 4:] == -1).all()
    assert int(small.counters[scheduler.COUNTERS.index("evictions")]) == \
        int(s.counters[scheduler.COUNTERS.index("evictions")]) + 2 * 4


def _pressure_setup(seed=0):
    cfg = HiSparseConfig(num_kv_heads=2, head_dim=64, gqa_group=2, max_context=4096,
                         max_seqs=2, budget_tokens=1024)
    rng = np.random.default_rng(seed)
    lengths = (3000, 2100)
    kvs = [_bf16_exact(rng, n + 24, cfg) for n in lengths]
    return cfg, rng, lengths, kvs


def test_offload_fits_a_shrinking_budget_and_keeps_exact_outputs():
    cfg, rng, lengths, kvs = _pressure_setup()
    off = OffloadedCache(_fill(cfg, kvs, lengths, 0))
    full = off.device_bytes()
    assert off.fit_device_budget(full) == cfg  # fits: nothing changes
    lvl = off.fit_device_budget(full - 1)       # a byte short: the hot window goes first
    assert (lvl.hot_tokens, lvl.budget_tokens) == (64, 1024) and off.device_bytes() < full
    lvl = off.fit_device_budget(off.device_bytes() - 1)  # then the budget halves
    # The working set stays 2x the candidates: 2 x 1.25 x 32 pages.
    assert (lvl.hot_tokens, lvl.budget_tokens, off.working_set) == (64, 512, 80)
    low = off.device_bytes()
    with pytest.raises(pressure.DeviceBudgetError, match="nothing changed"):
        off.fit_device_budget(low - 1)
    assert off.cfg == lvl and off.device_bytes() == low
    ref = _fill(lvl, kvs, lengths, 0)
    for t in range(24):
        if t == 12:  # pressure eases: the budget grows back, the hot window does not
            back = off.fit_device_budget(full)
            assert (back.hot_tokens, back.budget_tokens, off.working_set) == (64, 1024, 160)
            ref.cfg = back
        k, v = (np.stack([x[lengths[b] + t] for b, x in enumerate(col)])
                for col in zip(*kvs))
        off.append(k, v)
        ref.append(k, v)
        q = rng.normal(size=(2, cfg.num_q_heads, 64)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(off.attend(q)), np.asarray(ref.attend(q)))


def test_offload_refuses_an_impossible_budget_at_build_and_leaves_the_cache_usable():
    cfg, rng, lengths, kvs = _pressure_setup(1)
    cache = _fill(cfg, kvs, lengths, 0)
    q = rng.normal(size=(2, cfg.num_q_heads, 64)).astype(np.float32)
    before = np.asarray(cache.attend(q))
    with pytest.raises(pressure.DeviceBudgetError, match="below this cache's smallest"):
        OffloadedCache(cache, device_budget=100_000)
    np.testing.assert_array_equal(np.asarray(cache.attend(q)), before)
    off = OffloadedCache(cache, device_budget=10**9)  # plenty: the configured tiers
    assert off.cfg == cfg and jax.tree.leaves(off.state)
