"""Offload mode: the cold pool's int4 codes and value scales live in host memory.

The device keeps everything else (digests, sink/hot/warm tiers, page tables) and
a working set of W cold pages per (sequence, KV head). Each decode step selects
pages from the digests on the device, the scheduler (`scheduler.plan`) names the
pages to copy in, the host copies exactly those (and nothing else crosses the
bus), and attention reads the working set. The bytes are the same ones the
all-resident cache would read, so the outputs are equal bit for bit.

The `HiSparseCache` handed in keeps doing everything else (input checks,
prefill, append, release, prefix sharing, prewarm); this class is its
`cold_store`: new cold pages go to the host, released sequences leave the
working set. Shared prefix pages are one host page, as they are one pool page.

The host pool is a set of JAX arrays in host memory: `memory_kind="pinned_host"`
where the platform has it (GPUs, and the CPU backend of jax 0.11), else
"unpinned_host". New cold pages are scattered into it and fetched pages gathered
from it by XLA computations placed on the host (`compute_on("device_host")`),
and the gathered pages alone are copied to device memory: the same code path on
a CPU and on a GPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hisparse_jax.attention import (
    Selection,
    attend_cold_slots,
    pool_pages,
    remember,
    select,
    take_or_none,
)
from hisparse_jax.cache import layout, pressure
from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import HiSparseCache, log
from hisparse_jax.compat import compute_on
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.validate import check_int, check_working_set

HOST_FIELDS = ("int4_k", "int4_v", "int4_v_scale", "int4_v_zero")
# The scheduler's per-sequence fields (a step over the first slots takes theirs).
SCHED_SLOT_FIELDS = ("resident", "score", "last_used")


def _without_cold_codes(state):
    """The device state keeps no cold codes: empty arrays of the right rank."""
    return state.replace(**{f: jnp.zeros((x.shape[0], 0) + x.shape[2:], x.dtype)
                            for f in HOST_FIELDS for x in [getattr(state, f)]})


def host_memory_kind(device) -> str:
    """The host memory kind cold pages live in on `device`'s platform."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    raise ValueError(f"{device} has no host memory kind (has {sorted(kinds)}); offload "
                     "mode needs jax memory kinds")


@compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _host_scatter(pool, pool_ids, pages):
    return pool.at[:, pool_ids].set(jnp.swapaxes(pages, 0, 1), mode="drop")


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _store_pages(host, pools, pool_ids, pages):
    """Scatter new cold pages into the host pool (pool_ids >= pool size dropped).
    pools {field: [Hkv, P, ...]} in host memory; pages {field: [n, Hkv, ...]} on
    the device."""
    pool_ids = jax.device_put(pool_ids, host)
    return {f: _host_scatter(pools[f], pool_ids, jax.device_put(pages[f], host))
            for f in pools}


@jax.jit
def _slots_of(resident, logical):
    """Slot (b*W + w) of each selected logical page, -1 where none. resident
    [B, Hkv, W], logical [B, Hkv, K] (every selected page is resident after apply)."""
    b, _, w = resident.shape
    match = (resident[:, :, None, :] == logical[..., None]) & (logical[..., None] >= 0)
    slot = jnp.argmax(match, axis=-1)
    base = (jnp.arange(b) * w)[:, None, None]
    return jnp.where(jnp.any(match, axis=-1), base + slot, -1).astype(jnp.int32)


@jax.jit
def _buffer_slots(want, in_ws, held):
    """Sample-buffer bookkeeping for one step, per (sequence, KV head) row: want
    [B, Hkv, n] the sampled logical pages (-1 = none), in_ws [B, Hkv, n] whether each
    is resident in the working set, held [B, Hkv, n] the page in each buffer slot
    (-1 = empty). A page already held is read where it is; the others (each page
    once) take the buffer slots no entry of this step reads, lowest first.
    Returns (buffer slot of each entry [B, Hkv, n], -1 = not read from the buffer;
    page to copy into each slot [B, Hkv, n], -1 = none; held after the copies)."""
    def row(want, in_ws, held):
        n = want.shape[0]
        todo = (want >= 0) & ~in_ws
        match = (want[:, None] == held[None, :]) & todo[:, None] & (held[None, :] >= 0)
        found = jnp.any(match, axis=1)
        need = todo & ~found
        same = (want[:, None] == want[None, :]) & need[:, None] & need[None, :]
        first_of = jnp.argmax(jnp.tril(same | jnp.eye(n, dtype=bool)), axis=1)
        first = need & (first_of == jnp.arange(n))      # a page's first entry copies it
        spare = jnp.argsort(jnp.any(match, axis=0), stable=True)  # free slots first
        new_slot = spare[jnp.clip(jnp.cumsum(first) - 1, 0, n - 1)]
        slot = jnp.where(found, jnp.argmax(match, axis=1),
                         jnp.where(need, new_slot[first_of], -1))
        copy = jnp.full(n, -1, want.dtype).at[jnp.where(first, new_slot, n)].set(
            want, mode="drop")
        return slot.astype(jnp.int32), copy, jnp.where(copy >= 0, copy, held)
    return jax.vmap(jax.vmap(row))(want, in_ws, held)


@jax.jit
def _move_slots(ws, src):
    """Working-set data re-slotted after `scheduler.resize`: ws [Hkv, B*W, ...],
    src [B, Hkv, W'] (old slot per new slot, -1 = empty) -> [Hkv, B*W', ...]."""
    b, h, w_new = src.shape

    def one(x):
        x = x.reshape(h, b, -1, *x.shape[2:])                      # [Hkv, B, W, ...]
        idx = jnp.maximum(src, 0).transpose(1, 0, 2)               # [Hkv, B, W']
        idx = idx.reshape(idx.shape + (1,) * (x.ndim - 3))
        got = jnp.take_along_axis(x, idx, axis=2)
        ok = (src >= 0).transpose(1, 0, 2).reshape(idx.shape)
        return jnp.where(ok, got, jnp.zeros((), x.dtype)).reshape(h, b * w_new, *x.shape[3:])
    return {f: one(x) for f, x in ws.items()}


@jax.jit
def _plan_sample(resident, sample, held, page_table):
    """The sample buffer's bookkeeping for this step's sampled pages (`_buffer_slots`):
    (working-set slot of each [B, Hkv, n] (-1: not resident), buffer slot (-1:
    none), held after the copies, pool pages to copy into each buffer slot)."""
    in_ws = _slots_of(resident, sample)
    in_buffer, copy, held = _buffer_slots(sample, in_ws >= 0, held)
    return in_ws, in_buffer, held, pool_pages(page_table, copy)


class Planned(NamedTuple):
    """The device half of a step's cold-page traffic, planned before any copy
    (`plan_copies`), over the step's first `width` slots."""
    sel: Selection          # the step's selection
    in_ws: jax.Array        # [n, Hkv, S] working-set slot of each sampled page (-1: none)
    in_buffer: jax.Array    # [n, Hkv, S] its sample-buffer slot (-1: none)
    copies: jax.Array       # [n, Hkv, 2W + S] pool pages to copy in, -1 = none: the
                            # prefetch's W, then the selection's W, then the sample's S


def plan_copies(cfg: HiSparseConfig, state, q, sched, held, below=None, *, width=None,
                implementation=None, has_below=None):
    """Everything a step decides on the device before the host copies pages:
    the layer-ahead prefetch of `below` [B, Hkv, K'] (the layer below's
    candidates; None or LRU: none), the selection over slots 0..width-1, the
    scheduler's plan for it and the sample buffer's bookkeeping, with the
    scheduler state and `held` committed. has_below (a traced bool): False plans
    as with `below` None, so that a loop over every layer runs the first one, which
    has no layer below, in the same body. Jit-traceable: the serving engine runs it
    in the same program as the layer's projections. -> (sched, held, Planned)."""
    b, h, w = sched.resident.shape
    n = b if width is None else min(width, b)
    prefetch = jnp.full((n, h, w), -1, jnp.int32)
    if below is not None and sched.policy.kind != "lru":
        pp = scheduler.plan_prefetch(sched, below)
        fetched = pool_pages(state.page_table, pp.fetch)[:n]
        # a barrier: fused with the plan's own score update below, the scores
        # would round differently at different widths (FMA contraction)
        ahead = jax.lax.optimization_barrier(scheduler.apply_prefetch(sched, pp))
        if has_below is None:
            prefetch, sched = fetched, ahead
        else:  # a select, not a branch: the values either way, bit for bit
            prefetch = jnp.where(has_below, fetched, prefetch)
            sched = jax.tree.map(lambda a, s: jnp.where(has_below, a, s), ahead, sched)
    part_cfg, part = st.first_slots(cfg, state, n)
    full_sched, full_held = sched, held
    sched = sched.replace(**{f: getattr(sched, f)[:n] for f in SCHED_SLOT_FIELDS})
    sel = select(part_cfg, part, q[:n], implementation=implementation)
    plan = scheduler.plan(sched, sel.pages)
    fetch = pool_pages(part.page_table, plan.fetch)
    sched = scheduler.apply(sched, plan)
    in_ws = in_buffer = sel.sample
    copy = jnp.zeros((n, h, 0), jnp.int32)
    held = held[:n]
    if sel.sample.shape[-1]:  # tail_sample_pages > 0: fill the sample buffer too
        in_ws, in_buffer, held, copy = _plan_sample(sched.resident, sel.sample, held,
                                                    part.page_table)
    sched = sched.replace(**{f: getattr(full_sched, f).at[:n].set(getattr(sched, f))
                             for f in SCHED_SLOT_FIELDS})
    return (sched, full_held.at[:n].set(held),
            Planned(sel, in_ws, in_buffer, jnp.concatenate([prefetch, fetch, copy], -1)))


def attend_planned(cfg: HiSparseConfig, state, q, ws, sample_ws, sched, held, planned, *,
                   implementation=None):
    """Attention over the resident pages once `planned`'s copies are in (the working
    set, then the sample buffer): -> (out [B, Hq, D], candidates [B, Hkv, C], kept,
    last_selected [B, Hkv, max_pages]). Slots past the plan's width: out rows 0,
    candidates and kept -1, last_selected as it was. Jit-traceable."""
    b = q.shape[0]
    n = planned.in_ws.shape[0]
    part_cfg, part = st.first_slots(cfg, state, n)
    out, kept, last = _attend_resident(part_cfg, part, q[:n], ws, sample_ws,
                                       sched.resident[:n], held[:n], planned.sel,
                                       planned.in_ws, planned.in_buffer, implementation)
    pad = lambda x, fill: jnp.full((b, *x.shape[1:]), fill, x.dtype).at[:n].set(x)
    return (pad(out, 0), pad(planned.sel.pages, -1), pad(kept, -1),
            state.last_selected.at[:n].set(last))


def _attend_resident(cfg, state, q, ws, sample_ws, resident, sample_held, sel, in_ws,
                     in_buffer, implementation):
    """Attention over the resident pages: the working set followed by the sample
    buffer, with their digests (device to device). -> (out, kept, last_selected)."""
    b, h, w = resident.shape
    n = sample_held.shape[-1]
    base = b * w + (jnp.arange(b) * n)[:, None, None]
    sample_slots = jnp.where(in_ws >= 0, in_ws, jnp.where(in_buffer >= 0, base + in_buffer, -1))
    rows = jnp.concatenate([resident.transpose(1, 0, 2).reshape(h, -1),
                            sample_held.transpose(1, 0, 2).reshape(h, -1)], axis=1)
    seq = jnp.concatenate([jnp.repeat(jnp.arange(b), w), jnp.repeat(jnp.arange(b), n)])
    pool = jnp.where(rows >= 0, state.page_table[seq[None, :], jnp.maximum(rows, 0)], 0)
    heads = jnp.arange(h)[:, None]
    # the first b slots' rows (all of them unless a step runs on fewer slots)
    cold = tuple(jnp.concatenate([ws[f][:, :b * w], sample_ws[f][:, :b * n]], axis=1)
                 for f in HOST_FIELDS) + (
        state.digest_center[heads, pool], state.digest_radius[heads, pool])
    out, kept = attend_cold_slots(cfg, state, q, cold, _slots_of(resident, sel.pages),
                                  sample_slots, sel.sample_logw, implementation=implementation)
    return out, kept, remember(cfg, state, sel.pages).last_selected


_plan_copies = jax.jit(plan_copies, static_argnames=("cfg", "width", "implementation"))
_attend_planned = jax.jit(attend_planned, static_argnames=("cfg", "implementation"))


def _put(ws, sample_ws, heads, prefetch_slots, fetch_slots, sample_slots, pages, layer=None):
    """Copied pages into their slots: the prefetch's, then the selection's (a slot
    the plan refills after a prefetch ends with the later page), then the sample
    buffer's. ws [Hkv, B*W, ...], sample_ws [Hkv, B*S, ...] (with `layer`: stacked
    [L, Hkv, ...], written at that layer); each slot array names one slot per row
    of `pages` (out of range: not that buffer's row)."""
    where = (lambda slots: (heads, slots)) if layer is None else (
        lambda slots: (layer, heads, slots))
    put = lambda buf, slots: {f: buf[f].at[where(slots)].set(pages[f], mode="drop")
                              for f in buf}
    return put(put(ws, prefetch_slots), fetch_slots), put(sample_ws, sample_slots)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2, 3, 4))
def _copy_in(shardings, pools, ws, sample_ws, copied, copies, working_set):
    """`copy_pages` for one layer's pool (`ColdStore.copy_in`), its counts added
    to `copied`."""
    ws, sample_ws, counts = copy_pages(shardings, pools, None, ws, sample_ws, copies,
                                       working_set)
    return ws, sample_ws, copied + counts


class ColdStore:
    """One cache layer's cold pool in host memory, with what offload mode keeps on
    the device for it: a working set of W cold pages per (sequence, KV head), the
    scheduler that fills it, and the sample buffer. `attend` selects from the
    digests, copies exactly the pages the plan fetches and attends.

    `OffloadedCache` is one of these behind a `HiSparseCache` (the serving
    engine's layer-stacked state has `LayerColdStores`). The caller owns the
    device state (passed in, returned updated) and writes new cold pages here
    (`store`).
    """

    def __init__(self, cfg: HiSparseConfig, host: dict, device, working_set: int,
                 policy: scheduler.Policy | None = None):
        """host {HOST_FIELDS: [Hkv, P, ...]}: the pool's codes, any memory (moved to
        `device`'s host memory kind); working_set: W, checked by the caller."""
        self.memory_kind = host_memory_kind(device)
        self._host = SingleDeviceSharding(device, memory_kind=self.memory_kind)
        self._device = SingleDeviceSharding(device, memory_kind="device")
        self.host = {f: jax.device_put(host[f], self._host) for f in HOST_FIELDS}
        b, w = cfg.max_seqs, working_set
        self.working_set = w
        self.ws = {f: jnp.zeros((cfg.num_kv_heads, b * w) + self.host[f].shape[2:],
                                self.host[f].dtype) for f in HOST_FIELDS}
        # Sampled pages (`attention.sample_tail`) that were not resident when drawn,
        # outside the scheduler's working set; `sample_held` names each slot's page,
        # so a page drawn again is not copied again.
        self.sample_ws = {f: jnp.zeros((cfg.num_kv_heads, b * cfg.sample_pages)
                                       + self.host[f].shape[2:], self.host[f].dtype)
                          for f in HOST_FIELDS}
        self.sample_held = jnp.full((b, cfg.num_kv_heads, cfg.sample_pages), -1, jnp.int32)
        # The last step's candidate pages [B, Hkv, C] (logical, -1 = none): what the
        # layer above should `prefetch`. None before the first `attend`.
        self.candidates = None
        self.sched = scheduler.init_state(b, cfg.num_kv_heads, w, policy or scheduler.Policy())
        # Committed to the device, as every later value of them is: one program
        # per shape (jit compiles again for an uncommitted argument).
        # [pages copied, rows moved, sampled pages copied] (`copy_pages`), int32
        self.copied = jnp.zeros(3, jnp.int32)
        self.ws, self.sample_ws, self.sample_held, self.sched, self.copied = jax.device_put(
            (self.ws, self.sample_ws, self.sample_held, self.sched, self.copied), self._device)
        # The int32 device counters (the scheduler's, `copied`) are moved here
        # (int64) and zeroed when read, so a long-running server never sees them wrap.
        self.counted = np.zeros(len(scheduler.COUNTERS), np.int64)
        self.copied_total = np.zeros(3, np.int64)
        self.page_bytes = scheduler.page_bytes(cfg)

    def store(self, pool_ids, cold):
        """New cold pages: pool_ids [n] (>= pool size: none), cold {field: [n, Hkv,
        page, ...]} -> the host pool."""
        self.host = _store_pages(self._host, self.host, pool_ids,
                                 {f: cold[f] for f in HOST_FIELDS})

    def forget(self, seq):
        """Sequence `seq` is empty: none of its pages may stay resident."""
        self.sched = scheduler.forget_sequence(self.sched, seq)
        self.sample_held = self.sample_held.at[seq].set(-1)

    def device_bytes(self) -> int:
        """The working set, sample buffer and scheduler state."""
        return (layout.nbytes(self.ws) + layout.nbytes(self.sample_ws)
                + layout.nbytes(self.sched))

    def resize(self, working_set: int):
        """Another working set size (memory pressure); the resident pages that fit stay."""
        if working_set != self.working_set:
            self.sched, src = scheduler.resize(self.sched, working_set)
            self.ws = _move_slots(self.ws, src)
            self.working_set = working_set

    def attend(self, cfg: HiSparseConfig, state, q, implementation=None, width=None):
        """Decode attention for q [B, Hq, D] over `state` (its cold codes here):
        -> (out [B, Hq, D], candidates [B, Hkv, C], kept (`attend_cold_slots`),
        the state with the candidates remembered). width: compute only slots
        0..width-1 (`state.decode_width`; the others' rows of out are 0, their
        candidates and kept -1, and their working sets stay as they were). The
        working set and sample buffer keep their full size: the first slots'
        pages sit at the same offsets in them. Three programs, the three parts
        the serving engine runs inside its layer loop: plan (`plan_copies`), copy
        (`copy_in`), attend (`attend_planned`); none waits on the host."""
        self.sched, self.sample_held, planned = _plan_copies(
            cfg, state, q, self.sched, self.sample_held, width=width,
            implementation=implementation)
        self.copy_in(planned.copies)
        out, self.candidates, kept, last = _attend_planned(
            cfg, state, q, self.ws, self.sample_ws, self.sched, self.sample_held, planned,
            implementation=implementation)
        return out, self.candidates, kept, state.replace(last_selected=last)

    def prefetch(self, state, pages):
        """Layer-ahead prefetch of pages [B, Hkv, K'] (logical, checked by the
        caller); see `OffloadedCache.prefetch`. LRU fetches nothing."""
        if self.sched.policy.kind == "lru":
            return
        plan = scheduler.plan_prefetch(self.sched, pages)
        fetch = pool_pages(state.page_table, plan.fetch)
        self.sched = scheduler.apply_prefetch(self.sched, plan)
        self.copy_in(jnp.concatenate([fetch, jnp.full_like(fetch, -1)], axis=-1))

    def copy_in(self, copies):
        """Host -> device: the pages `copies` [n, Hkv, 2W + S] names (pool pages, -1 =
        none; `Planned.copies`, the first n slots' rows), each into its slot: the
        first W into the working set (prefetch), the next W too (the selection's
        misses, after the prefetch), the last S into the sample buffer
        (`copy_pages`: on the device, no host sync)."""
        self.ws, self.sample_ws, self.copied = _copy_in(
            (self._host, self._device), self.host, self.ws, self.sample_ws, self.copied,
            copies, self.working_set)

    def _copies(self) -> np.ndarray:
        """[pages copied, rows moved, sampled pages copied] so far (int64)."""
        now = np.asarray(self.copied)
        if now.any():
            self.copied_total = self.copied_total + now
            self.copied = jax.device_put(np.zeros(3, np.int32), self._device)
        return self.copied_total

    host_to_device_bytes = property(lambda self: int(self._copies()[0]) * self.page_bytes)
    sample_pages_copied = property(lambda self: int(self._copies()[2]))

    def counters(self, cfg: HiSparseConfig) -> dict:
        """The scheduler's counters (selected, hits, misses, fetched, prefetched,
        evictions, hit_rate, host->device bytes), the resident cold pages, the
        sample buffer's copies and the bytes copied."""
        now = np.asarray(self.sched.counters).astype(np.int64)
        if now.any():
            self.counted = self.counted + now
            self.sched = self.sched.replace(counters=jax.device_put(
                np.zeros(now.shape, np.int32), self._device))
        out = dict(scheduler.counters(self.sched, cfg, since=self.counted))
        out["resident_pages"] = int(jnp.sum(self.sched.resident >= 0))
        copied = self._copies()
        out["sample_pages_copied"] = int(copied[2])
        out["host_to_device_bytes_copied"] = int(copied[0]) * self.page_bytes
        out["host_to_device_bytes_moved"] = int(copied[1]) * self.page_bytes  # with padding
        return out


class OffloadedCache:
    """A HiSparseCache (empty or filled, with or without a prefix index) whose cold
    codes live in host memory from now on. prefill / append / release / prewarm /
    attend / counters work as on the cache.

    device_budget (bytes): the device memory this cache may use. Over it, the
    cache moves to the least degraded `pressure.levels` that fits (smaller hot
    window, then smaller selection budget and working set), or raises
    `pressure.DeviceBudgetError` and changes nothing (the HiSparseCache handed in
    stays usable). `fit_device_budget` does the same later, on a running cache.
    """

    def __init__(self, cache: HiSparseCache, working_set: int | None = None,
                 policy: scheduler.Policy | None = None, device_budget: int | None = None):
        # Every check comes before the cache's cold codes move out.
        if not isinstance(cache, HiSparseCache):
            raise ValueError(f"cache must be a HiSparseCache, got {type(cache).__name__}")  # noqa: TRY004
        cfg = cache.cfg
        if cache.cold_store is not None:
            raise ValueError("this cache is already offloaded")
        w = check_working_set(cfg.candidate_pages, 2 * cfg.candidate_pages
                              if working_set is None else working_set)
        if policy is not None and not isinstance(policy, scheduler.Policy):
            raise ValueError(f"policy must be a scheduler.Policy, got {policy!r}")
        if device_budget is not None:  # refuse before taking the cache's buffers
            device_budget = check_int("device_budget", device_budget, minimum=1)
            self._pick_level(cfg, cfg, w / cfg.candidate_pages, device_budget,
                             jax.eval_shape(_without_cold_codes, cache.state))
        self.cfg = cfg
        self.nominal = cfg  # the configured tiers; pressure levels derive from it
        self.working_set_multiple = w / cfg.candidate_pages
        self.implementation = cache.implementation
        self.cache = cache  # checks, host mirrors, prefix index and the device state
        state = cache.state
        device = next(iter(state.int4_k.devices()))
        self.store_ = ColdStore(cfg, {f: getattr(state, f) for f in HOST_FIELDS}, device, w,
                                policy)
        cache.state = _without_cold_codes(state)
        cache.cold_store = self
        if device_budget is not None:
            self.fit_device_budget(device_budget)
        log.info(layout.summary_line(self.cfg, device_bytes=self.device_bytes(),
                                     host_bytes=layout.nbytes(self.host)))

    @property
    def state(self):
        return self.cache.state

    @property
    def prefix(self):
        return self.cache.prefix

    # The cold store's parts, as attributes of the cache (tests and benchmarks read them).
    memory_kind = property(lambda self: self.store_.memory_kind)
    host = property(lambda self: self.store_.host)
    ws = property(lambda self: self.store_.ws)
    sample_ws = property(lambda self: self.store_.sample_ws)
    sample_held = property(lambda self: self.store_.sample_held)
    sched = property(lambda self: self.store_.sched)
    working_set = property(lambda self: self.store_.working_set)
    candidates = property(lambda self: self.store_.candidates)
    host_to_device_bytes = property(lambda self: self.store_.host_to_device_bytes)

    # ------------------------------------------------------------ the cache's cold store
    def store(self, pool_ids, cold):
        """New cold pages from prefill/append: pool_ids [n] (>= pool size: none),
        cold {field: [n, Hkv, page, ...]} -> the host pool."""
        self.store_.store(pool_ids, cold)

    def forget(self, seq):
        """Sequence `seq` is empty: none of its pages may stay resident."""
        self.store_.forget(seq)

    # ------------------------------------------------------------ the cache's API
    def prefill(self, seq: int, k, v, tokens=None):
        self.cache.prefill(seq, k, v, tokens)

    def prewarm(self, context_id: str, tokens, k, v, seq: int | None = None):
        self.cache.prewarm(context_id, tokens, k, v, seq)

    def append(self, k, v, active=None):
        self.cache.append(k, v, active)

    def release(self, seq: int):
        self.cache.release(seq)

    # ------------------------------------------------------------ memory pressure
    def device_bytes(self) -> int:
        """Every device byte this cache holds: tiers, digests, tables, working set
        and scheduler state."""
        return layout.nbytes(self.state) + self.store_.device_bytes()

    @staticmethod
    def _pick_level(nominal: HiSparseConfig, current: HiSparseConfig, multiple: float,
                    budget: int, state_shapes) -> tuple[HiSparseConfig, int]:
        """The least degraded level reachable from `current` (the hot window cannot
        grow back) whose device bytes fit `budget`: (config, working set)."""
        need = []
        for lvl in pressure.levels(nominal):
            if lvl.hot_tokens > current.hot_tokens:
                continue
            w = max(lvl.candidate_pages, round(multiple * lvl.candidate_pages))
            shapes = state_shapes
            if lvl.hot_tokens != current.hot_tokens:
                shapes = jax.eval_shape(functools.partial(st.retier, current, lvl), shapes)
            total = (layout.nbytes(shapes)
                     + scheduler.working_set_bytes(lvl, w, batch=nominal.max_seqs))
            if total <= budget:
                return lvl, w
            need.append(total)
        raise pressure.DeviceBudgetError(
            f"device budget {budget} B is below this cache's smallest footprint "
            f"{min(need)} B (hot window {pressure.MIN_HOT_TOKENS} tokens, selection "
            f"budget {pressure.levels(nominal)[-1].budget_tokens} tokens); nothing changed")

    def fit_device_budget(self, budget: int) -> HiSparseConfig:
        """Move to the least degraded pressure level that fits `budget` device bytes
        (shrinking or, when the pressure eased, growing the selection budget back);
        raises DeviceBudgetError and changes nothing if none fits. Returns the
        config now in use."""
        budget = check_int("budget", budget, minimum=1)
        lvl, w = self._pick_level(self.nominal, self.cfg, self.working_set_multiple, budget,
                                  self.state)
        if lvl.hot_tokens != self.cfg.hot_tokens or lvl.warm_tokens != self.cfg.warm_tokens:
            st.check_retier(self.cfg, lvl)
            self.cache.state = st.retier(self.cfg, lvl, self.state,
                                         implementation=self.implementation)
        self.store_.resize(w)
        if lvl != self.cfg:
            log.info("HiSparse under device budget %d B: hot %d tokens, selection budget "
                     "%d tokens, working set %d pages", budget, lvl.hot_tokens,
                     lvl.budget_tokens, w)
        self.cfg = lvl
        self.cache.cfg = lvl
        return lvl

    def attend(self, q, *, return_selection=False):
        c = self.cfg
        self.cache._check_kv("q", q, (c.max_seqs, c.num_q_heads, c.head_dim))
        out, logical, kept, self.cache.state = self.store_.attend(
            c, self.state, jnp.asarray(q), implementation=self.implementation)
        return (out, take_or_none(logical, kept)) if return_selection else out

    def prefetch(self, pages):
        """Layer-ahead prefetch: `pages` [B, Hkv, K'] (logical, -1 = none) is the
        layer below's selection at this step, the best predictor of this layer's:
        its candidates (`candidates` of that layer's cache after its `attend`; the
        pages `attend(..., return_selection=True)` returns are the subset it
        attended). Call it before
        this layer's `attend`; the copies are dispatched asynchronously, so on a
        GPU they overlap the layer below's attention. Fetches at most the policy's
        `max_prefetch` pages per (sequence, KV head), never evicting the last
        step's selection; LRU fetches nothing."""
        self.store_.prefetch(self.state, self._check_pages(pages))

    def _check_pages(self, pages) -> jax.Array:
        """Logical page ids [B, Hkv, K]: integers, each -1 or a cold page of its
        sequence (a float id or one past the context names no page)."""
        c = self.cfg
        arr = np.asarray(pages)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"pages must be integer logical page ids, got dtype {arr.dtype}")
        if arr.ndim != 3 or arr.shape[:2] != (c.max_seqs, c.num_kv_heads):
            raise ValueError(f"pages must be [{c.max_seqs}, {c.num_kv_heads}, K], "
                             f"got {tuple(arr.shape)}")
        first = c.sink_pages
        end = first + st.num_cold_pages(c, self.cache.seq_lens)[:, None, None]
        bad = (arr != -1) & ((arr < first) | (arr >= end))
        if bad.any():
            b, h, _ = np.argwhere(bad)[0]
            raise ValueError(f"pages[{b}, {h}] holds {int(arr[bad][0])}, not a cold page of "
                             f"sequence {b} (cold pages {first}..{int(end[b, 0, 0]) - 1}) "
                             "nor -1")
        return jnp.asarray(arr, jnp.int32)

    def counters(self) -> dict:
        """The scheduler's counters (selected, hits, misses, fetched, prefetched,
        evictions, hit_rate, host->device bytes), the cache's tier and prefix
        counters, and the resident cold pages."""
        return {**self.cache.counters(), **self.store_.counters(self.cfg)}


# ---------------------------------------------------------------- every layer in one program

COPY_CHUNK = 64  # pages a copy inside a step moves at a time (a page is ~1 KiB)


@compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _host_scatter_layers(pool, layers, pool_ids, pages):
    return pool.at[layers, :, pool_ids].set(pages, mode="drop")


@compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
def _host_gather(pools, *index):
    return {f: pool[index] for f, pool in pools.items()}


def store_pages(host, pools, pool_ids, pages):
    """New cold pages of every layer into the stacked host pools: pools {field:
    [L, Hkv, P, ...]} in host memory (sharding `host`), pool_ids [L, n] (>= P:
    none), pages {field: [L, n, Hkv, ...]} on the device. Jit-traceable."""
    layers = jnp.broadcast_to(jnp.arange(pool_ids.shape[0])[:, None], pool_ids.shape)
    on_host = lambda x: jax.device_put(x, host)
    return {f: _host_scatter_layers(pools[f], on_host(layers), on_host(pool_ids),
                                    on_host(pages[f])) for f in pools}


_store_layers = jax.jit(store_pages, static_argnums=0, donate_argnums=1)


def copy_pages(shardings, pools, layer, ws, sample_ws, copies, working_set, fresh=None):
    """The pages `copies` [n, Hkv, 2W + S] names (`Planned.copies`) from the host
    pools into their slots of the working set and sample buffer, on the device,
    for layer `layer` (traced) of stacked pools, written in place in the stacked
    `ws` and `sample_ws` ({field: [L, Hkv, slots, ...]}); layer None: one
    layer's pools and buffers ([Hkv, ...], `ColdStore.copy_in`). The pages to copy are moved to the
    front (in row order, so a slot's later copy still wins) and copied COPY_CHUNK
    at a time, as many times as there are pages: no host sync, and only those
    pages (and the last chunk's padding) cross. fresh (pool ids [B], codes {field:
    [B, Hkv, ...]}): the pages that became cold in this step, still on the device
    (`_store_layers` writes them after the layers). shardings: (host, device).
    Jit-traceable. -> (ws, sample_ws, [pages copied, rows moved, sampled pages])."""
    host, device = shardings
    j = copies.shape[-1]
    w, s = working_set, j - 2 * working_set
    flat = copies.reshape(-1)
    valid = flat >= 0
    count = jnp.sum(valid, dtype=jnp.int32)
    rows = -(-flat.size // COPY_CHUNK) * COPY_CHUNK
    order = jnp.pad(jnp.argsort(~valid, stable=True), (0, rows - flat.size))
    live = jnp.arange(rows) < count
    b, head, k = (x.astype(jnp.int32) for x in jnp.unravel_index(order, copies.shape))
    pool_id = jnp.where(live, flat[order], 0)
    part = jnp.where(k < w, 0, jnp.where(k < 2 * w, 1, 2))
    slot = jnp.where(part < 2, b * w + k % w, b * s + k - 2 * w)
    none = jnp.iinfo(jnp.int32).max
    slots = [jnp.where(live & (part == p), slot, none) for p in range(3)]
    on_host = lambda x: jax.device_put(x, host)

    def body(carry):
        i, ws, sample_ws = carry
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, i, COPY_CHUNK)
        heads, ids = take(head), take(pool_id)
        where = (heads, ids) if layer is None else (jnp.full_like(heads, layer), heads, ids)
        pages = jax.device_put(_host_gather(pools, *map(on_host, where)), device)
        if fresh is not None:
            fresh_ids, codes = fresh
            match = ids[:, None] == fresh_ids[None, :]
            hit, src = jnp.any(match, axis=1), jnp.argmax(match, axis=1)
            pages = {f: jnp.where(hit.reshape((-1,) + (1,) * (x.ndim - 1)),
                                  codes[f][src, heads], x) for f, x in pages.items()}
        ws, sample_ws = _put(ws, sample_ws, heads, *(take(x) for x in slots), pages, layer)
        return i + COPY_CHUNK, ws, sample_ws

    _, ws, sample_ws = jax.lax.while_loop(lambda c: c[0] < count, body,
                                          (jnp.int32(0), ws, sample_ws))
    sampled = jnp.sum(valid & (jnp.arange(flat.size) % j >= 2 * w), dtype=jnp.int32)
    moved = -(-count // COPY_CHUNK) * COPY_CHUNK
    return ws, sample_ws, jnp.stack([count, moved, sampled])


class LayerColdStores(NamedTuple):
    """Offload mode's cold parts of a layer-stacked state (the serving engine's,
    `models.engine`): every layer's host pool, working set, sample buffer and
    scheduler state (as a `ColdStore` holds one layer's) stacked on a leading layer
    axis, so that a decode step reads and writes them all in one program. A
    pytree: the step takes and returns it whole. `copied`: [pages copied, rows
    moved, sampled pages copied] since the counters were last read."""
    host: dict          # {field: [L, Hkv, P, ...]} in host memory
    ws: dict            # {field: [L, Hkv, B*W, ...]}
    sample_ws: dict     # {field: [L, Hkv, B*S, ...]}
    sample_held: jax.Array  # [L, B, Hkv, S]
    sched: scheduler.SchedulerState  # stacked [L, ...]
    copied: jax.Array   # [3] int32

    @classmethod
    def empty(cls, cfg: HiSparseConfig, layers: int, device, working_set: int,
              policy: scheduler.Policy | None = None) -> LayerColdStores:
        """Empty pools made in host memory (never on the device), empty working sets."""
        host_sh, device_sh = shardings(device)
        shapes = jax.eval_shape(lambda: st.init_state(cfg))
        host = {f: jax.device_put(np.zeros((layers,) + getattr(shapes, f).shape,
                                           getattr(shapes, f).dtype), host_sh)
                for f in HOST_FIELDS}
        b, h, w, s = cfg.max_seqs, cfg.num_kv_heads, working_set, cfg.sample_pages
        slots = lambda n: {f: jnp.zeros((layers, h, n) + x.shape[3:], x.dtype)
                           for f, x in host.items()}
        sched = scheduler.init_state(b, h, w, policy or scheduler.Policy())
        # committed to the device, as every later value of them is (one program per shape)
        device_parts = jax.device_put(
            (slots(b * w), slots(b * s), jnp.full((layers, b, h, s), -1, jnp.int32),
             jax.tree.map(lambda x: jnp.repeat(x[None], layers, axis=0), sched),
             jnp.zeros(3, jnp.int32)), device_sh)
        return cls(host, *device_parts)

    @property
    def working_set(self) -> int:
        return self.sched.resident.shape[-1]

    def store(self, pool_ids, cold) -> LayerColdStores:
        """A prefill's new cold pages: pool ids [L, n] (>= pool size: none), codes
        {field: [L, n, Hkv, ...]} -> the host pools."""
        host_sh = next(iter(self.host.values())).sharding
        return self._replace(host=_store_layers(host_sh, self.host, pool_ids,
                                                {f: cold[f] for f in HOST_FIELDS}))

    def forget(self, seq) -> LayerColdStores:
        """Sequence `seq` is empty: none of its pages may stay resident in any layer."""
        return self._replace(
            sched=jax.vmap(lambda s: scheduler.forget_sequence(s, seq))(self.sched),
            sample_held=self.sample_held.at[:, seq].set(-1))

    def device_bytes(self) -> int:
        """The working sets, sample buffers and scheduler states."""
        return (layout.nbytes(self.ws) + layout.nbytes(self.sample_ws)
                + layout.nbytes(self.sched))

    def take_counts(self, counted: np.ndarray, copied: np.ndarray):
        """The int32 device counters added into the host's int64 ones (`counted`
        [len(COUNTERS)], `copied` [3]) and zeroed, so that a long-running server
        never sees them wrap. -> (self with zeroed counters, counted, copied)."""
        now = np.asarray(self.sched.counters).astype(np.int64).sum(axis=0)
        moved = np.asarray(self.copied).astype(np.int64)
        if not (now.any() or moved.any()):
            return self, counted, copied
        zeros = lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)
        out = self._replace(sched=self.sched.replace(counters=zeros(self.sched.counters)),
                            copied=zeros(self.copied))
        return out, counted + now, copied + moved


def shardings(device) -> tuple[SingleDeviceSharding, SingleDeviceSharding]:
    """(host, device) shardings of offload mode's arrays on `device`."""
    return (SingleDeviceSharding(device, memory_kind=host_memory_kind(device)),
            SingleDeviceSharding(device, memory_kind="device"))
