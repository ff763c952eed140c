"""Prefix hashing and a host-side prefix index (DESIGN §2.1 "content hashing").

A full page's identity is a chained MurmurHash3 of its token ids:
    hash(page 0) = mmh3(seed || tokens of page 0)
    hash(page i) = mmh3(hash(page i-1) || tokens of page i)
so equal hashes mean equal prefixes (up to collisions). The index maps a page
hash to the pool pages that hold it, the token ids (to verify every hit: a
mismatch is a counted collision, never a reuse), a reference count and a pinned
flag (prewarmed documents). Eviction order: unpinned prefixes with no references,
oldest use first; pinned or referenced entries are never evicted.

Ownership: an index holds one cache's pool page ids, so it serves exactly one
cache (`HiSparseCache` binds it, and a second cache is refused): a model gives
each layer's cache its own index. Token ids are integer arrays (floats are
refused, never truncated into a "match").

Pure Python/numpy, no device code. The cache calls it like this:

    hashes = page_hashes(tokens, page_size)
    n, pages = index.match(tokens, page_size)     # reuse the first n full pages
    index.acquire(hashes[:n])                     # the sequence references them
    ... prefill the rest, then index.insert(tokens, page_size, pool_pages)
    index.release(hashes)                         # when the sequence ends
    freed = index.evict(k)                        # pool pages to push on the free stack
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import struct
from collections.abc import Callable, Sequence

import mmh3
import numpy as np

from hisparse_jax.validate import check_int, check_token_ids, is_int

HASH_SEED = 0x48695370  # "HiSp"


def mmh3_page_hash(prev: int | None, tokens: np.ndarray) -> int:
    """128-bit MurmurHash3 (x64) of (previous page hash, token ids as little-endian int64)."""
    head = struct.pack("<?QQ", prev is not None, *(divmod(prev or 0, 1 << 64)[::-1]))
    body = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return mmh3.hash128(head + body, HASH_SEED, signed=False)


def page_hashes(tokens: Sequence[int], page_size: int,
                hash_fn: Callable = mmh3_page_hash) -> list[int]:
    """Chained hashes of every full page of `tokens` (a partial last page has none)."""
    check_int("page_size", page_size, minimum=1)
    t = check_token_ids("tokens", tokens)
    out, prev = [], None
    for i in range(len(t) // page_size):
        prev = hash_fn(prev, t[i * page_size:(i + 1) * page_size])
        out.append(prev)
    return out


@dataclasses.dataclass
class Entry:
    pages: tuple            # pool page ids holding this logical page (e.g. one per layer)
    tokens: tuple           # token ids of this page (verification)
    parent: int | None      # hash of the previous page (None for page 0); with the
                            # page's tokens it verifies the whole prefix by induction
    refcount: int = 0
    pinned: bool = False
    last_use: int = 0
    children: int = 0       # entries whose parent this is (evicted only after them)


class PrefixIndex:
    """hash -> Entry. Counts: hits, misses, collisions, evictions."""

    def __init__(self, page_size: int, hash_fn: Callable = mmh3_page_hash,
                 allocate: Callable[[int], Sequence] | None = None):
        """allocate(n) -> n pool page entries, used by prewarm when no pages are given
        (the cache passes its free-page allocator)."""
        self.page_size = check_int("page_size", page_size, minimum=1)
        self.hash_fn = hash_fn
        self.allocate = allocate
        self.entries: dict[int, Entry] = {}
        self.contexts: dict[str, list[int]] = {}   # prewarmed context id -> page hashes
        self.owner: dict[int, int] = {}            # pool page id -> hash of its entry
        self.stats = {"hits": 0, "misses": 0, "collisions": 0, "evictions": 0}
        self._clock = itertools.count(1)
        self.bound = False  # a cache holds this index (`bind`)
        self._on_free = None  # the bound cache's hook for pool pages evict() frees
        self._writing = False

    def bind(self, on_free: Callable[[list], None]):
        """Called by the cache that takes this index; its entries will name that
        cache's pool pages, which no other cache has. on_free(pool pages) drops the
        references `evict` gives up. From now on insert / prewarm / acquire /
        release come from that cache only (`writer`): they must stay in step with
        its device page references."""
        if self.bound:
            raise ValueError("this PrefixIndex already serves another cache, and its entries "
                             "name that cache's pool pages: give each cache (each layer) its "
                             "own PrefixIndex")
        if self.entries:
            raise ValueError(f"a cache can only take an empty PrefixIndex (this one holds "
                             f"{len(self.entries)} entries for pages the cache never wrote)")
        self.bound = True
        self._on_free = on_free

    @contextlib.contextmanager
    def writer(self):
        """The bound cache's own updates (see `bind`)."""
        self._writing = True
        try:
            yield self
        finally:
            self._writing = False

    def _check_writer(self, what: str):
        if self.bound and not self._writing:
            raise ValueError(f"PrefixIndex.{what}: this index belongs to a cache, whose device "
                             "page references must match it; use the cache's prefill / "
                             "prewarm / release instead")

    # ------------------------------------------------------------ lookups
    def hashes(self, tokens) -> list[int]:
        return page_hashes(tokens, self.page_size, self.hash_fn)

    def _verify(self, h: int, page_tokens: tuple, parent: int | None,
                stats: dict | None = None) -> Entry | None:
        """The entry at h if it holds these tokens after this (verified) parent; a
        different holder is a collision (counted in `stats`, default the index's;
        None returned)."""
        e = self.entries.get(h)
        if e is None:
            return None
        if e.tokens != page_tokens or e.parent != parent:
            (self.stats if stats is None else stats)["collisions"] += 1
            return None
        return e

    def match(self, tokens, count: bool = True) -> tuple[int, list[tuple]]:
        """Longest reusable prefix: (number of full pages n, pool pages of each).
        Every hit is verified against the token ids; a mismatch is a collision and
        ends the match (the page is never reused). Without `count` the lookup
        leaves the hit / miss / collision counts alone (a look ahead)."""
        stats = self.stats if count else dict(self.stats)
        t = tuple(int(x) for x in check_token_ids("tokens", tokens))
        pg = self.page_size
        pages, parent = [], None
        for i, h in enumerate(self.hashes(t)):
            e = self._verify(h, t[i * pg:(i + 1) * pg], parent, stats)
            if e is None:
                stats["misses"] += 1
                break
            stats["hits"] += 1
            e.last_use = next(self._clock)
            pages.append(e.pages)
            parent = h
        return len(pages), pages

    # ------------------------------------------------------------ updates
    def insert(self, tokens, pool_pages: Sequence) -> list[int]:
        """Register the full pages of `tokens` held in `pool_pages` (one item per full
        page: a pool page id or a tuple of them). Pages already indexed (same tokens)
        are kept as they are; the caller's duplicate pool pages stay the caller's.
        A hash held by different tokens (collision) is counted and that page and
        the rest of the prefix are not indexed. Returns the hashes indexed or found."""
        self._check_writer("insert")
        t = tuple(int(x) for x in check_token_ids("tokens", tokens))
        hs = self.hashes(t)
        if len(pool_pages) < len(hs):
            raise ValueError(f"{len(hs)} full pages need {len(hs)} pool page entries, "
                             f"got {len(pool_pages)}")
        entries = []
        for pages in pool_pages[:len(hs)]:  # checked before anything is indexed
            pages = tuple(pages) if isinstance(pages, (tuple, list, np.ndarray)) else (pages,)
            if not all(is_int(p) and p >= 0 for p in pages):
                raise ValueError(f"pool pages must be ints >= 0, got {pages!r}")
            entries.append(tuple(int(p) for p in pages))
        pg, done, parent = self.page_size, [], None
        for i, h in enumerate(hs):
            page_tokens = t[i * pg:(i + 1) * pg]
            pages = entries[i]
            if h in self.entries:
                if self._verify(h, page_tokens, parent) is None:
                    break
            else:
                taken = [p for p in pages if p in self.owner]
                if taken:
                    raise ValueError(f"pool pages {taken} already belong to an indexed prefix")
                self.entries[h] = Entry(pages=pages, tokens=page_tokens, parent=parent,
                                        last_use=next(self._clock))
                if parent is not None:
                    self.entries[parent].children += 1
                for p in pages:
                    self.owner[p] = h
            done.append(h)
            parent = h
        return done

    def acquire(self, hashes: Sequence[int]):
        """A sequence starts using these pages (all must be indexed)."""
        self._check_writer("acquire")
        missing = [h for h in hashes if h not in self.entries]
        if missing:
            raise KeyError(f"{len(missing)} hashes are not indexed")
        for h in hashes:
            e = self.entries[h]
            e.refcount += 1
            e.last_use = next(self._clock)

    def release(self, hashes: Sequence[int]):
        """A sequence stops using these pages. Releasing more than acquired raises
        before anything changes."""
        self._check_writer("release")
        need: dict[int, int] = {}
        for h in hashes:
            need[h] = need.get(h, 0) + 1
        for h, n in need.items():
            e = self.entries.get(h)
            if e is None or e.refcount < n:
                raise ValueError("release without a matching acquire")
        for h, n in need.items():
            self.entries[h].refcount -= n

    def prewarm(self, context_id: str, tokens, pool_pages: Sequence | None = None) -> list[int]:
        """Index a long document once and pin it under `context_id` (never evicted
        until `unpin(context_id)`). Without pool_pages, pages come from `allocate`."""
        self._check_writer("prewarm")
        if not isinstance(context_id, str) or not context_id:
            raise ValueError(f"context_id must be a non-empty str, got {context_id!r}")
        if context_id in self.contexts:
            raise ValueError(f"context {context_id!r} is already prewarmed")
        tokens = check_token_ids("tokens", tokens)
        if pool_pages is None:
            if self.allocate is None:
                raise ValueError("prewarm needs pool_pages or an index built with allocate=")
            pool_pages = self.allocate(len(self.hashes(tokens)))
        hs = self.insert(tokens, pool_pages)
        for h in hs:
            self.entries[h].pinned = True
        self.contexts[context_id] = hs
        return hs

    def unpin(self, context_id: str):
        if context_id not in self.contexts:
            raise ValueError(f"context {context_id!r} is not prewarmed")
        hs = self.contexts.pop(context_id)
        still = {h for other in self.contexts.values() for h in other}
        for h in hs:
            if h in self.entries and h not in still:
                self.entries[h].pinned = False

    def _evictable(self, h: int) -> bool:
        e = self.entries[h]
        # A page is evicted only after its descendants (a child's chain names it).
        return not (e.pinned or e.refcount or e.children)

    def eviction_order(self) -> list[int]:
        """Evictable hashes (unpinned, unreferenced, leaves first), oldest use first."""
        return sorted((h for h in self.entries if self._evictable(h)),
                      key=lambda h: self.entries[h].last_use)

    def evict(self, max_entries: int | None = None, max_pages: int | None = None) -> list[int]:
        """Evict up to max_entries (None: all that can go), oldest first, stopping once
        max_pages pool pages are freed; returns the freed pool pages (a bound cache
        drops its references to them at once)."""
        if max_entries is not None:
            max_entries = check_int("max_entries", max_entries, minimum=0)
        if max_pages is not None:
            max_pages = check_int("max_pages", max_pages, minimum=0)
        freed, n = [], 0
        heap = [(self.entries[h].last_use, h) for h in self.eviction_order()]
        while heap and (max_entries is None or n < max_entries) and (
                max_pages is None or len(freed) < max_pages):
            _, h = heapq.heappop(heap)
            e = self.entries.pop(h)
            for p in e.pages:
                del self.owner[p]
            freed.extend(e.pages)
            self.stats["evictions"] += 1
            n += 1
            if e.parent is not None:  # a leaf gone: its parent may be one now
                self.entries[e.parent].children -= 1
                if self._evictable(e.parent):
                    heapq.heappush(heap, (self.entries[e.parent].last_use, e.parent))
        if freed and self._on_free is not None:
            self._on_free(freed)
        return freed

    # ------------------------------------------------------------ views
    def live_pages(self) -> set:
        return set(self.owner)

    def __len__(self):
        return len(self.entries)
