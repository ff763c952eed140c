"""Offload mode moves bytes, it never changes results."""

import numpy as np
import pytest

from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness.workloads import make_workload
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.offload.store import OffloadedCache


@pytest.mark.parametrize("policy", [scheduler.Policy(), scheduler.LRU])
def test_offload_outputs_equal_all_resident(policy, implementation):
    # Interpret-mode Pallas on a CPU is several times slower: half the context.
    s, max_context = (3000, 4096) if implementation == "pallas" else (6000, 8192)
    steps = 40
    w = make_workload(context=s + steps, num_kv_heads=2, gqa_group=4, head_dim=64,
                      num_queries=steps, seed=7)
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=4, head_dim=64, max_context=max_context,
                         max_seqs=2, budget_tokens=512)
    full = HiSparseCache(cfg, implementation)
    moved = HiSparseCache(cfg, implementation)
    for c in (full, moved):
        c.prefill(0, w.k[:s], w.v[:s])
        c.prefill(1, w.k[:s - 999], w.v[:s - 999])
    off = OffloadedCache(moved, working_set=2 * cfg.budget_pages, policy=policy)
    assert off.state.int4_k.size == 0  # no cold codes on the device
    for t in range(steps):
        kk = np.stack([w.k[s + t], w.k[s - 999 + t]])
        vv = np.stack([w.v[s + t], w.v[s - 999 + t]])
        full.append(kk, vv)
        off.append(kk, vv)
        q = np.stack([w.q[t], w.q[(t + 1) % steps]])
        a, sel_a = full.attend(q, return_selection=True)
        b, sel_b = off.attend(q, return_selection=True)
        np.testing.assert_array_equal(np.asarray(sel_a), np.asarray(sel_b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = off.counters()
    assert c["hits"] + c["misses"] == c["selected"] > 0
    # Every byte copied is a fetched page: the scheduler's, or a sampled page that
    # was not resident (attention.sample_tail).
    assert c["host_to_device_bytes_copied"] == c["host_to_device_bytes"] + \
        c["sample_pages_copied"] * scheduler.page_bytes(cfg)
    assert c["hit_rate"] > 0.5  # consecutive decode steps share most pages


def test_working_set_must_hold_budget():
    cfg = HiSparseConfig(num_kv_heads=2, head_dim=64, max_context=4096, budget_tokens=512)
    with pytest.raises(ValueError, match="working_set"):
        OffloadedCache(HiSparseCache(cfg), working_set=8)


def test_sample_buffer_forgets_a_released_sequence():
    """A new sequence in a released slot, of the same length, draws the same tail
    pages: they must be copied again, not read stale from the sample buffer."""
    s = 4000
    a_kv = make_workload(context=s, num_kv_heads=2, gqa_group=4, head_dim=64,
                         num_queries=2, seed=3)
    b_kv = make_workload(context=s, num_kv_heads=2, gqa_group=4, head_dim=64,
                         num_queries=2, seed=4)
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=4, head_dim=64, max_context=4096,
                         budget_tokens=256)
    full, moved = HiSparseCache(cfg), HiSparseCache(cfg)
    for c in (full, moved):
        c.prefill(0, a_kv.k, a_kv.v)
    off = OffloadedCache(moved)
    q = a_kv.q[:1]
    np.testing.assert_array_equal(np.asarray(full.attend(q)), np.asarray(off.attend(q)))
    assert off.counters()["sample_pages_copied"] > 0
    for c in (full, off):
        c.release(0)
        c.prefill(0, b_kv.k, b_kv.v)
    # Without the buffer forgetting the released sequence this output differs.
    np.testing.assert_array_equal(np.asarray(full.attend(q)), np.asarray(off.attend(q)))


def _buffer_slots_loop(want, in_ws, held):
    """The sample buffer's rule, one entry at a time: a held page is read where it
    is; a new page (once) takes the lowest slot no entry of this step reads."""
    held = held.copy()
    slot = np.full(want.shape, -1)
    copy = np.full(want.shape, -1)
    for b, h in np.ndindex(want.shape[:2]):
        where = {int(p): j for j, p in enumerate(held[b, h]) if p >= 0}
        todo = [i for i in range(want.shape[2]) if want[b, h, i] >= 0 and not in_ws[b, h, i]]
        used = {where[int(want[b, h, i])] for i in todo if int(want[b, h, i]) in where}
        spare = [j for j in range(want.shape[2]) if j not in used]
        for i in todo:
            p = int(want[b, h, i])
            if p not in where:
                where[p] = spare.pop(0)
                held[b, h, where[p]] = copy[b, h, where[p]] = p
            slot[b, h, i] = where[p]
    return slot, copy, held


@pytest.mark.parametrize("pages, resident_share, empty_share", [
    (40, 0.3, 0.05),   # repeats within a step, some pages held from earlier steps
    (8, 0.0, 0.0),     # few distinct pages: many repeats, the buffer fills up
    (1000, 0.9, 0.5),  # mostly resident or empty entries
])
def test_sample_buffer_bookkeeping_matches_a_plain_loop(pages, resident_share, empty_share):
    import jax.numpy as jnp

    from hisparse_jax.offload.store import _buffer_slots
    rng = np.random.default_rng(pages)
    shape = (3, 2, 16)
    held = np.full(shape, -1)
    for _ in range(12):  # held pages carry over between steps
        want = rng.integers(0, pages, shape)
        want[rng.random(shape) < empty_share] = -1
        in_ws = rng.random(shape) < resident_share
        got = _buffer_slots(jnp.asarray(want, jnp.int32), jnp.asarray(in_ws),
                            jnp.asarray(held, jnp.int32))
        expect = _buffer_slots_loop(want, in_ws, held)
        for g, e in zip(got, expect):
            np.testing.assert_array_equal(np.asarray(g), e)
        held = expect[2]


@pytest.mark.parametrize("tail_sample_pages", [0, 1, 32])
def test_offload_with_any_tail_sample_size(tail_sample_pages):
    """No sample, a one-page sample and the default: outputs equal all-resident over
    a few steps, and only a sample copies pages into the sample buffer."""
    wl = make_workload(context=4096, num_kv_heads=2, num_queries=2, seed=1)
    cfg = HiSparseConfig(num_kv_heads=2, max_context=4096, budget_tokens=256,
                         tail_sample_pages=tail_sample_pages)
    ref, inner = (HiSparseCache(cfg, implementation="xla") for _ in range(2))
    for c in (ref, inner):
        c.prefill(0, wl.k, wl.v)
    off = OffloadedCache(inner)
    for i in range(4):
        q = wl.q[i % 2][None]
        np.testing.assert_array_equal(np.asarray(off.attend(q)), np.asarray(ref.attend(q)))
    assert (off.counters()["sample_pages_copied"] > 0) == (tail_sample_pages > 0)


def test_copy_in_puts_each_page_in_its_slot():
    """`ColdStore.copy_in`, the step's one host-to-device copy: a page the plan
    fetches into a slot the prefetch filled this step ends there (the later copy
    wins), a sampled page lands in the sample buffer, nothing else is written, and
    the bytes counted are the pages named."""
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=4096,
                         max_seqs=2, budget_tokens=256)
    w = make_workload(context=3000, num_kv_heads=2, gqa_group=2, head_dim=64,
                      num_queries=1, seed=5)
    cache = HiSparseCache(cfg)
    cache.prefill(1, w.k, w.v)
    store = OffloadedCache(cache).store_
    host = {f: np.asarray(x) for f, x in store.host.items()}
    ws_w, s = store.working_set, cfg.sample_pages
    assert s > 0
    # four of sequence 1's cold pages (pool ids), each row different
    a, b, c, d = np.asarray(cache.state.page_table)[1, cfg.sink_pages:][:4]
    assert len({host["int4_k"][h, p].tobytes() for h in (0, 1) for p in (a, b, c, d)}) == 8
    copies = np.full((2, 2, 2 * ws_w + s), -1, np.int32)
    copies[1, 1, 3] = a             # prefetch: page a into slot 3 of (seq 1, head 1)
    copies[1, 1, ws_w + 3] = b      # the plan refills slot 3 with page b
    copies[1, 0, ws_w + 5] = c      # the plan: page c into slot 5 of (seq 1, head 0)
    copies[1, 0, 2 * ws_w + 2] = d  # a sampled page into sample slot 2 of (seq 1, head 0)
    store.copy_in(copies)
    for f, x in host.items():
        want_ws = np.zeros_like(np.asarray(store.ws[f]))
        want_sample = np.zeros_like(np.asarray(store.sample_ws[f]))
        want_ws[1, ws_w + 3] = x[1, b]
        want_ws[0, ws_w + 5] = x[0, c]
        want_sample[0, s + 2] = x[0, d]
        np.testing.assert_array_equal(np.asarray(store.ws[f]), want_ws)
        np.testing.assert_array_equal(np.asarray(store.sample_ws[f]), want_sample)
    assert store.host_to_device_bytes == 4 * scheduler.page_bytes(cfg)
    assert store.sample_pages_copied == 1


@pytest.mark.parametrize("fresh", [False, True], ids=["stored", "fresh"])
def test_copy_pages_inside_a_program_puts_each_page_in_its_slot(fresh):
    """`offload.copy_pages`, the engine's in-program copy (no host sync), against a
    numpy replay of `copies` in row order (a slot's later copy wins): layer 1 of
    two stacked host pools, 150 pages over three chunks of COPY_CHUNK, one slot
    copied twice across a chunk boundary (prefetch in the first chunk, the plan's
    refill in the second), sampled pages, and, with `fresh`, pages that became
    cold this step read from the device rather than the stale host pool."""
    import jax
    import jax.numpy as jnp

    from hisparse_jax.offload import store as offload

    rng = np.random.default_rng(3)
    layers, heads, pages, b, w, s = 2, 3, 400, 4, 40, 8
    fields = {"int4_k": ((16, 32), np.uint8), "int4_v_scale": ((16,), np.float32)}
    make = lambda shape, dt: (rng.integers(0, 255, shape).astype(dt) if dt == np.uint8
                              else rng.standard_normal(shape).astype(dt))
    host_np = {f: make((layers, heads, pages, *sh), dt) for f, (sh, dt) in fields.items()}
    copies = np.full((b, heads, 2 * w + s), -1, np.int32)
    flat = copies.reshape(-1)
    spots = np.sort(rng.choice(flat.size, 150, replace=False))
    flat[spots] = rng.integers(0, pages, 150)
    # (seq 1, head 1): slot 5 prefetched, then refilled by the plan, with the
    # prefetch's other slots and the plan's first ones between them
    row = (1 * heads + 1) * (2 * w + s)
    flat[row:row + 2 * w + s] = -1
    flat[row + 6:row + w + 5] = rng.integers(0, pages, w - 1)
    flat[row + 5], flat[row + w + 5] = 11, 12
    assert np.sum(flat[:row + 5] >= 0) < offload.COPY_CHUNK <= np.sum(flat[:row + w + 5] >= 0)
    fresh_ids = np.array([12, pages, 7, pages], np.int32)  # pages 12 and 7 are new
    codes = {f: make((b, heads, *sh), dt) for f, (sh, dt) in fields.items()}
    want_ws = {f: np.zeros((heads, b * w, *sh), dt) for f, (sh, dt) in fields.items()}
    want_sample = {f: np.zeros((heads, b * s, *sh), dt) for f, (sh, dt) in fields.items()}
    for bi, h, j in zip(*np.nonzero(copies >= 0), strict=True):
        page = copies[bi, h, j]
        for f in fields:
            src = host_np[f][1, h, page]
            if fresh and page in fresh_ids:
                src = codes[f][list(fresh_ids).index(page), h]
            if j < 2 * w:
                want_ws[f][h, bi * w + j % w] = src
            else:
                want_sample[f][h, bi * s + j - 2 * w] = src
    dev = jax.devices()[0]
    sh = offload.shardings(dev)
    pools = {f: jax.device_put(x, sh[0]) for f, x in host_np.items()}
    # stacked working sets of two layers: layer 1 is written, layer 0 must stay zero
    zeros = lambda want: {f: jnp.zeros((2, *x.shape), x.dtype) for f, x in want.items()}

    @jax.jit
    def run(pools, ws, sample_ws, copies):
        return offload.copy_pages(sh, pools, jnp.int32(1), ws, sample_ws, copies, w,
                                  (jnp.asarray(fresh_ids), jax.tree.map(jnp.asarray, codes))
                                  if fresh else None)

    ws, sample_ws, counts = run(pools, zeros(want_ws), zeros(want_sample), copies)
    for f in fields:
        np.testing.assert_array_equal(np.asarray(ws[f][1]), want_ws[f])
        np.testing.assert_array_equal(np.asarray(sample_ws[f][1]), want_sample[f])
        assert not np.asarray(ws[f][0]).any() and not np.asarray(sample_ws[f][0]).any()
    n = int(np.sum(copies >= 0))
    sampled = int(np.sum(copies[..., 2 * w:] >= 0))
    assert np.asarray(counts).tolist() == [n, -(-n // offload.COPY_CHUNK) * offload.COPY_CHUNK,
                                           sampled]
