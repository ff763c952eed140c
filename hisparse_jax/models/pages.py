"""The host's bookkeeping of an engine's cold pool: how many pages each layer has
free, and prefix sharing (`PoolPages`); a dense cache has no pool (`NoPool`).

Prefix sharing: every prompt's full cold pages go into one `PrefixIndex` for all
layers (an entry's pages are one global id per layer, layer * pool_pages + page).
A later prompt that starts with the same tokens references those pool pages
instead of storing its own (`shared`: the pages a prefill is given), so N
sequences over one document hold its cold pages once. `pin` keeps a prompt's
pages after its sequence ends (a prewarmed document); unpinned pages nobody uses
stay indexed and are evicted, oldest first, when the pool runs short
(`available` counts them as free).

Every layer holds the same tokens, so one count on the host (`num_free`, per
layer) decides whether a prefill or a decode step fits, without a device read:
the pool's raw operations trust their caller (on an empty free stack they would
hand out a page another sequence holds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import CacheFullError
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig


@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=1)
def _page_refs(cfg: HiSparseConfig, caches, pages, retain: bool):
    """Take (retain) or drop one prefix-index reference on each pool page of
    pages [L, n] (-1 = skip), layer by layer."""
    f = st.retain_pages if retain else st.drop_pages
    return jax.vmap(lambda s, p: st.stored(f(cfg, st.live(cfg, s), p)))(caches, pages)


@jax.jit
def _slot_pages(page_table, poisoned, slot):
    """`slot`'s page table [L, max_pages] and whether a layer poisoned it: one program
    for every slot and prompt length (indexing with Python ints compiles one each)."""
    return page_table[:, slot], jnp.any(poisoned[:, slot])


class NoPool:
    """A cache without a cold pool (dense): nothing to count, share or evict."""

    prefix = None
    num_free = 0
    evicted_pages = 0

    def make_room(self, need: int):
        pass

    def hold_prefix(self, slot: int, ids, count: bool, check_prompt: Callable) -> int:
        return 0

    def drop_hold(self, slot: int):
        pass

    def shared(self, slot: int, t: int):
        return None

    def shared_batch(self, slots, t: int):
        return None

    def begin_fill(self, slot: int, ids, n: int, count: bool, taken: int,
                   check_prompt: Callable) -> int:
        return 0

    def end_fill(self, slot: int, ids, need: int):
        pass

    def release(self, slot: int):
        pass

    def pin(self, slot: int, context_id: str):
        pass

    def unpin(self, context_id: str):
        pass

    def available(self) -> int:
        return 0

    def cached_pages(self) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {}

    def step_pages(self, lens: np.ndarray, active: np.ndarray) -> int:
        return 0

    def take(self, pages: int):
        pass

    def usage(self) -> tuple[int, int]:
        return 0, 0

    def tier_tokens(self, lens: np.ndarray) -> dict[str, int]:
        return {}


class PoolPages:
    """A HiSparse engine's cold pool on the host: pages free per layer, the prefix
    index, each slot's hold (the indexed prefix its coming prefill shares) and
    references (the index entries its sequence uses). `state` reads the engine's
    layer-stacked `CacheState` and `set_state` writes it back (the index's
    references are pool refcounts)."""

    def __init__(self, cfg: HiSparseConfig, layers: int, state: Callable,
                 set_state: Callable):
        self.cfg, self.layers = cfg, layers
        self._state, self._set_state = state, set_state
        self.prefix = PrefixIndex(cfg.page_size)
        self.prefix.bind(self._drop_pages)
        self.evicted_pages = 0  # per layer
        self.num_free = cfg.pool_pages  # per layer (every layer holds the same)
        self.holds: dict[int, tuple[list, list]] = {}  # slot -> (hashes, pages) to share
        self.refs: dict[int, list] = {}  # slot -> prefix hashes its sequence references

    def make_room(self, need: int):
        """CacheFullError unless `need` more cold pool pages (per layer) are free,
        after evicting unused, unpinned prefixes (oldest first)."""
        if need > self.num_free:  # `_drop_pages` frees what the index lets go
            self.prefix.evict(max_pages=(need - self.num_free) * self.layers)
        if need > self.num_free:
            raise CacheFullError(f"the cold KV pool holds {self.cfg.pool_pages} pages per "
                                 f"layer, {self.num_free} free; {need} more are needed: "
                                 "nothing was written")

    def _cold(self, n) -> int:
        return int(st.num_cold_pages(self.cfg, n)) if n else 0

    def _drop_pages(self, pages: list):
        """The prefix index evicted entries: drop its references to their pages."""
        state = _page_refs(self.cfg, self._state(), self._per_layer(pages), False)
        self._set_state(state)
        self.num_free = int(jnp.min(state.num_free))
        self.evicted_pages += len(pages) // self.layers

    def _per_layer(self, pages) -> jax.Array:
        """Global page ids (layer * pool_pages + page) -> [L, n] pages, -1 padded to a
        power of two (a few program shapes)."""
        p = self.cfg.pool_pages
        by = [[] for _ in range(self.layers)]
        for g in sorted(pages):
            by[g // p].append(g % p)
        out = np.full((self.layers, 1 << (max(1, *map(len, by)) - 1).bit_length()), -1,
                      np.int32)
        for layer, row in enumerate(by):
            out[layer, :len(row)] = row
        return jnp.asarray(out)

    def hold_prefix(self, slot: int, ids, count: bool, check_prompt: Callable) -> int:
        """`Engine.hold_prefix` (ids checked by `check_prompt` first)."""
        ids = check_prompt(ids)
        c = self.cfg
        n, pages = self.prefix.match(ids, count)
        m = min(n, c.sink_pages + self._cold(len(ids)))
        hashes = self.prefix.hashes(ids)[:m]
        with self.prefix.writer():
            self.prefix.acquire(hashes)
            old = self.holds.pop(slot, None)
            if old:
                self.prefix.release(old[0])
        self.holds[slot] = (hashes, pages[:m])
        return sum(1 for pg in pages[c.sink_pages:m] if pg)

    def drop_hold(self, slot: int):
        """Let go of `hold_prefix`'s references for `slot`."""
        hold = self.holds.pop(slot, None)
        if hold:
            with self.prefix.writer():
                self.prefix.release(hold[0])

    def shared(self, slot: int, t: int) -> jax.Array:
        """[L, t / page] pool pages `slot`'s hold shares (-1: the prompt stores its own)."""
        c = self.cfg
        out = np.full((self.layers, t // c.page_size), -1, np.int32)
        for i, pg in enumerate(self.holds.get(slot, ((), ()))[1]):
            if pg and i >= c.sink_pages:
                out[:, i] = [g - layer * c.pool_pages for layer, g in enumerate(pg)]
        return jnp.asarray(out)

    def shared_batch(self, slots, t: int) -> jax.Array:
        """[B, L, t / page]: `shared` of each of `slots`."""
        return jnp.stack([self.shared(slot, t) for slot in slots])

    def begin_fill(self, slot: int, ids, n: int, count: bool, taken: int,
                   check_prompt: Callable) -> int:
        """Before a prefill of n tokens into `slot` (emptied): hold the prompt's
        indexed prefix (with `ids`; without, no page is shared) and make room,
        beside `taken` pages that other prompts of the same batch will take; the
        new pages it will take."""
        need = self._cold(n)
        if ids is not None:
            need -= self.hold_prefix(slot, ids, count, check_prompt)
        else:
            self.drop_hold(slot)
        self.make_room(need + taken)
        return need

    def end_fill(self, slot: int, ids, need: int):
        """After a prefill: count its pages, index its full cold pages (with `ids`;
        never a poisoned sequence's) and let its hold go (the index references
        now cover the shared pages)."""
        self.num_free -= need
        hold = self.holds.pop(slot, None)
        if ids is not None:
            state = self._state()
            rows, poisoned = _slot_pages(state.page_table, state.poisoned, jnp.int32(slot))
            if not bool(poisoned):
                self._index(slot, ids, np.asarray(rows))
        if hold:
            with self.prefix.writer():
                self.prefix.release(hold[0])

    def _index(self, slot: int, ids, rows: np.ndarray):
        """Index the prompt's sink and cold pages (only cold pages are shared; the
        window's pages are the sequence's own), bounding the index's size. rows: the
        slot's page table [L, max_pages]."""
        c, layers = self.cfg, self.layers
        full = min(len(ids) // c.page_size, c.sink_pages + self._cold(len(ids)))
        if full <= c.sink_pages:
            return  # no cold page: nothing to share
        rows = rows[:, :full]
        base = np.arange(layers)[:, None] * c.pool_pages
        pages = [tuple(int(x) for x in rows[:, i] + base[:, 0]) if rows[:, i].min() >= 0
                 else () for i in range(full)]
        before = self.prefix.live_pages()
        with self.prefix.writer():
            hashes = self.prefix.insert(ids[:full * c.page_size], pages)
            self.prefix.acquire(hashes)
        self.refs[slot] = hashes
        new = self.prefix.live_pages() - before
        if new:  # the index's own reference: the pages outlive the sequence
            self._set_state(_page_refs(c, self._state(), self._per_layer(new), True))
        if len(self.prefix) > 2 * c.pool_pages + 1024:  # pages plus each chain's sink root
            self.prefix.evict(len(self.prefix) - 2 * c.pool_pages - 1024)

    def release(self, slot: int):
        """`slot`'s sequence ended (its pages were released on the device): its index
        references go, and the free count is read back (shared pages: data
        dependent)."""
        refs = self.refs.pop(slot, None)
        if refs:
            with self.prefix.writer():
                self.prefix.release(refs)
        self.num_free = int(jnp.min(self._state().num_free))

    def pin(self, slot: int, context_id: str):
        """`Engine.pin`."""
        hashes = self.refs.get(slot)
        if not hashes:
            return
        self.unpin(context_id)  # pinned again: the new prompt's pages
        entries = [self.prefix.entries[h] for h in hashes]
        with self.prefix.writer():
            self.prefix.prewarm(context_id, [t for e in entries for t in e.tokens],
                                [e.pages for e in entries])

    def unpin(self, context_id: str):
        if context_id in self.prefix.contexts:
            self.prefix.unpin(context_id)

    def available(self) -> int:
        """Pages (per layer) free or held only by unused, unpinned index entries."""
        return self.num_free + self.cached_pages()

    def cached_pages(self) -> int:
        """Pool pages (per layer) that only unused, unpinned prefix entries hold."""
        return sum(1 for e in self.prefix.entries.values()
                   if e.pages and not e.refcount and not e.pinned)

    def stats(self) -> dict[str, int]:
        """`Engine.prefix_stats`."""
        pinned = sum(1 for e in self.prefix.entries.values() if e.pages and e.pinned)
        return {**self.prefix.stats, "evictions": self.evicted_pages, "pinned_pages": pinned,
                "cached_pages": self.cached_pages()}

    def step_pages(self, lens: np.ndarray, active: np.ndarray) -> int:
        """The new cold pages (per layer) a decode step of the `active` slots at
        `lens` takes, room made for them."""
        before = lens.astype(np.int64)
        need = int(np.sum((st.num_cold_pages(self.cfg, before + active)
                           - st.num_cold_pages(self.cfg, before)) * (before > 0)))
        self.make_room(need)
        return need

    def take(self, pages: int):
        """A decode step took `pages` new pages (per layer)."""
        self.num_free -= pages

    def usage(self) -> tuple[int, int]:
        """`Engine.pool_usage`."""
        total = self.cfg.pool_pages * self.layers
        used = total - int(jnp.sum(self._state().num_free)) - self.cached_pages() * self.layers
        return used, total

    def tier_tokens(self, lens: np.ndarray) -> dict[str, int]:
        """Tokens per tier (sink, hot, warm, cold) over slots of `lens` (the
        arithmetic of `HiSparseCache.counters`)."""
        c = self.cfg
        lens, pg = lens.astype(np.int64), c.page_size
        held = lens > 0
        cold = st.num_cold_pages(c, lens) * held * pg
        sink = np.minimum(lens, c.sink_pages * pg)
        hot_start = np.maximum(c.sink_pages, (lens - 1) // pg - c.hot_pages + 1)
        hot = np.maximum(0, lens - hot_start * pg) * held
        warm = lens - sink - hot - cold
        return {"sink": int(sink.sum()), "hot": int(hot.sum()), "warm": int(warm.sum()),
                "cold": int(cold.sum())}
