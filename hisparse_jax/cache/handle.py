"""HiSparseCache: the checked, host-side handle on one layer's cache state.

The pure functions in `state.py` trust their inputs; this class checks every
input before any device work, so a bad call raises and changes nothing. It
mirrors the sequence lengths and the free-page count on the host, so checks
need no device round trip.

With a `PrefixIndex`, prefill reuses the cold pages of an equal, verified
prefix (by reference, no copy), registers its own, and `prewarm` pins a
document's pages for later sequences. Unpinned prefixes nobody uses are
evicted first when the pool runs short.

In offload mode (`offload.OffloadedCache`) a `cold_store` keeps the int4 codes:
prefill and append hand it every new cold page, release tells it the sequence
is gone; everything else here is unchanged.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import decode_step
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.cache import layout
from hisparse_jax.cache import state as st
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.validate import check_bool_mask, check_token_ids, is_int

FLOAT_DTYPES = (np.float16, np.float32, jnp.bfloat16)


log = logging.getLogger("hisparse")


class CacheFullError(RuntimeError):
    """The cold page pool cannot hold the request; nothing was written."""


class HiSparseCache:
    def __init__(self, cfg: HiSparseConfig, implementation=None,
                 prefix: PrefixIndex | None = None):
        if not isinstance(cfg, HiSparseConfig):
            raise ValueError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")  # noqa: TRY004
        if prefix is not None and not isinstance(prefix, PrefixIndex):
            raise ValueError(f"prefix must be a PrefixIndex or None, got {type(prefix).__name__}")
        if prefix is not None and prefix.page_size != cfg.page_size:
            raise ValueError(f"prefix index page_size {prefix.page_size} != {cfg.page_size}")
        resolve_implementation(implementation, cfg)  # an unknown or unfitting name fails here
        if prefix is not None:
            prefix.bind(self._drop)  # last: a refused cache leaves the index free
        self.cfg = cfg
        self.implementation = implementation
        self.prefix = prefix
        self.state = st.init_state(cfg)
        self.seq_lens = np.zeros(cfg.max_seqs, np.int64)
        self.num_free = cfg.pool_pages
        self.seq_hashes: dict[int, list] = {}  # prefix entries each sequence holds
        self.cold_store = None  # offload mode: where new cold pages go (OffloadedCache)
        log.info(layout.summary_line(cfg))

    # ------------------------------------------------------------ checks
    def _check_seq(self, seq: int) -> int:
        """seq as a Python int (a bool is refused: True would index every slot of
        the host mirrors)."""
        if not (is_int(seq) and 0 <= seq < self.cfg.max_seqs):
            raise ValueError(f"seq must be an int in [0, {self.cfg.max_seqs}), got {seq!r}")
        return int(seq)

    @staticmethod
    def _as_array(name, x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            try:
                x = np.asarray(x)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} must be an array: {e}")
        return x

    def _check_kv(self, name, x, shape):
        x = self._as_array(name, x)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        return x

    def _check_room(self, lengths_after: np.ndarray, lengths_before: np.ndarray):
        if np.any(lengths_after > self.cfg.max_context):
            raise ValueError(f"context {int(lengths_after.max())} exceeds max_context="
                             f"{self.cfg.max_context}")
        return int(np.sum(st.num_cold_pages(self.cfg, lengths_after)
                          - st.num_cold_pages(self.cfg, lengths_before)))

    # ------------------------------------------------------------ updates
    def prefill(self, seq: int, k, v, tokens=None):
        """Fill empty sequence `seq` with k, v [T, Hkv, D]. With a prefix index and
        the T token ids, cold pages of an indexed equal prefix are shared.

        Non-finite K/V poison the sequence (`poisoned`): its attention outputs are
        NaN until it is released, and its pages are never shared."""
        seq, k, v, tokens = self._check_prefill(seq, k, v, tokens)
        c = self.cfg
        t = k.shape[0]
        npg = -(-t // c.page_size)
        shared = np.full(npg, -1, np.int32)
        matched = []
        if self.prefix is not None and tokens is not None:
            n_cold = int(st.num_cold_pages(c, t))
            n, pages = self.prefix.match(tokens)
            matched = self.prefix.hashes(tokens)[:n]
            for p in range(c.sink_pages, min(n, c.sink_pages + n_cold)):
                if pages[p]:
                    shared[p] = pages[p][0]
            with self.prefix.writer():
                self.prefix.acquire(matched)  # not evictable while we make room
        need = int(st.num_cold_pages(c, t)) - int(np.sum(shared >= 0))
        try:
            self._make_room(need)
        finally:
            if matched:
                with self.prefix.writer():
                    self.prefix.release(matched)
        pad = -t % c.page_size
        if pad:
            k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
            v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
        args = (c, self.state, jnp.int32(seq), k, v, jnp.int32(t), jnp.asarray(shared))
        if self.cold_store is None:
            self.state = st.prefill(*args, implementation=self.implementation)
        else:  # the slot is empty: release (or offloading) left it no working set
            self.state, pool_ids, cold = st.prefill_offload(
                *args, implementation=self.implementation)
            self.cold_store.store(pool_ids, cold)
        self.seq_lens[seq] = t
        self.num_free -= need
        if self.prefix is not None and tokens is not None:
            if bool(self.state.poisoned[seq]):  # its pages must never reach another sequence
                log.warning("sequence %d holds non-finite K/V: poisoned, not indexed", seq)
            else:
                self._index(seq, tokens)

    def _check_prefill(self, seq, k, v, tokens):
        """Everything prefill checks, before any change: (seq, k, v, tokens)."""
        seq = self._check_seq(seq)
        k, v, tokens = self._check_prompt(k, v, tokens)
        if self.seq_lens[seq]:
            raise ValueError(f"sequence {seq} already holds {self.seq_lens[seq]} tokens; "
                             "prefill fills an empty sequence (use append for more)")
        return seq, k, v, tokens

    def _check_prompt(self, k, v, tokens):
        """k, v [T, Hkv, D] and the T token ids (or None), checked."""
        c = self.cfg
        k = self._as_array("k", k)
        if k.ndim != 3:
            raise ValueError(f"k must be [T, Hkv, D], got shape {tuple(k.shape)}")
        t = k.shape[0]
        k = self._check_kv("k", k, (t, c.num_kv_heads, c.head_dim))
        v = self._check_kv("v", v, (t, c.num_kv_heads, c.head_dim))
        if t == 0:
            raise ValueError("prefill needs at least one token")
        if tokens is not None:
            tokens = check_token_ids("tokens", tokens, t)
        if t > c.max_context:
            raise ValueError(f"context {t} exceeds max_context={c.max_context}")
        return jnp.asarray(k), jnp.asarray(v), tokens

    def _index(self, seq, tokens):
        """Register the sequence's full pages in the prefix index (the index takes a
        reference on each cold page it newly holds) and hold them while it lives."""
        c = self.cfg
        row = np.asarray(self.state.page_table[seq])
        full = len(tokens) // c.page_size
        pool_pages = [(int(row[p]),) if row[p] >= 0 else () for p in range(full)]
        before = self.prefix.live_pages()
        with self.prefix.writer():
            hashes = self.prefix.insert(tokens[:full * c.page_size], pool_pages)
            self.prefix.acquire(hashes)
        new = sorted(self.prefix.live_pages() - before)
        if new:
            self.state = st.retain_pages(c, self.state, jnp.asarray(new, jnp.int32))
        self.seq_hashes[seq] = hashes

    def _make_room(self, need):
        """Raise CacheFullError unless `need` pages are free, after evicting unused,
        unpinned prefixes (oldest first; referenced ones never go)."""
        while need > self.num_free and self.prefix is not None \
                and self.prefix.eviction_order():
            self.prefix.evict(1)  # `_drop` frees the pages
        if need > self.num_free:
            raise CacheFullError(f"cold page pool full: need {need} pages, {self.num_free} free "
                                 f"of {self.cfg.pool_pages}")

    def _drop(self, pool_pages: list):
        """The prefix index evicted entries: drop its references to their pages."""
        self.state = st.drop_pages(self.cfg, self.state, jnp.asarray(pool_pages, jnp.int32))
        self.num_free = int(self.state.num_free)

    def prewarm(self, context_id: str, tokens, k, v, seq: int | None = None):
        """Build a long document's cache once and pin its pages in the prefix index;
        later prefills that start with `tokens` reuse them. Uses an empty sequence
        slot (the first one by default) and frees it again. Every input is checked
        before the prefill, and a failure after it releases the slot."""
        if self.prefix is None:
            raise ValueError("prewarm needs a cache built with a PrefixIndex")
        if not isinstance(context_id, str) or not context_id:
            raise ValueError(f"context_id must be a non-empty str, got {context_id!r}")
        if context_id in self.prefix.contexts:
            raise ValueError(f"context {context_id!r} is already prewarmed")
        if tokens is None:
            raise ValueError("prewarm needs the document's token ids")
        k, v, tokens = self._check_prompt(k, v, tokens)
        if len(tokens) < self.cfg.page_size:
            raise ValueError(f"prewarm needs at least one full page ({self.cfg.page_size} "
                             f"tokens), got {len(tokens)}")
        if not bool(jnp.all(jnp.isfinite(k)) & jnp.all(jnp.isfinite(v))):
            raise ValueError("prewarm needs finite k and v: a pinned document with NaN or "
                             "Inf would poison every sequence that reuses it")
        if seq is None:
            empty = np.flatnonzero(self.seq_lens == 0)
            if not empty.size:
                raise CacheFullError("prewarm needs an empty sequence slot")
            seq = int(empty[0])
        self.prefill(seq, k, v, tokens)
        try:
            with self.prefix.writer():
                self.prefix.prewarm(context_id,
                                    tokens[:len(self.seq_hashes[seq]) * self.cfg.page_size],
                                    [self.prefix.entries[h].pages for h in self.seq_hashes[seq]])
        finally:
            self.release(seq)

    def append(self, k, v, active=None):
        """Append one token to each active sequence: k, v [B, Hkv, D]; active [B]
        bool, default: every sequence that holds tokens (an empty slot cannot be
        appended to: prefill it first). Rows of inactive slots are ignored."""
        c = self.cfg
        k = self._check_kv("k", k, (c.max_seqs, c.num_kv_heads, c.head_dim))
        v = self._check_kv("v", v, (c.max_seqs, c.num_kv_heads, c.head_dim))
        live = self.seq_lens > 0
        if active is None:
            active = live
        else:
            active = check_bool_mask("active", active, c.max_seqs)
            empty = np.flatnonzero(active & ~live)
            if empty.size:
                raise ValueError(f"active names empty sequences {empty.tolist()}: prefill "
                                 "them first")
        after = self.seq_lens + active
        need = self._check_room(after, self.seq_lens)
        self._make_room(need)
        args = (c, self.state, jnp.asarray(k), jnp.asarray(v), jnp.asarray(active))
        if self.cold_store is None:
            self.state = st.append_token(*args, implementation=self.implementation)
        else:
            self.state, pool_ids, cold = st.append_token_offload(
                *args, implementation=self.implementation)
            self.cold_store.store(pool_ids, cold)
        self.seq_lens = after
        self.num_free -= need

    def release(self, seq: int):
        """Empty sequence `seq`; its pages are freed unless shared or indexed."""
        seq = self._check_seq(seq)
        self.state = st.release(self.cfg, self.state, jnp.int32(seq))
        if self.prefix is not None and seq in self.seq_hashes:
            with self.prefix.writer():
                self.prefix.release(self.seq_hashes.pop(seq))
        self.seq_lens[seq] = 0
        self.num_free = int(self.state.num_free)  # shared pages make this data dependent
        if self.cold_store is not None:
            self.cold_store.forget(seq)

    # ------------------------------------------------------------ reads
    def counters(self) -> dict:
        """Host-side counters for a metrics endpoint: tokens per tier (live, over all
        sequences), cold pages referenced by page tables, pool pages in use (shared
        pages once) and free, and the prefix index's hits, misses, collisions and
        evictions (zero without an index)."""
        c = self.cfg
        lens = self.seq_lens
        pg, s = c.page_size, c.sink_pages
        sink = np.minimum(lens, s * pg)
        hot_start = np.maximum(s, (lens - 1) // pg - c.hot_pages + 1)  # first hot page
        hot = np.maximum(0, lens - hot_start * pg)
        warm = lens - sink - hot - st.num_cold_pages(c, lens) * pg
        out = {"sink_tokens": int(sink.sum()), "hot_tokens": int(hot.sum()),
               "warm_tokens": int(warm.sum()),
               "cold_pages": int(st.num_cold_pages(c, lens).sum()),
               "pool_pages_used": c.pool_pages - self.num_free, "pool_pages_free": self.num_free}
        stats = self.prefix.stats if self.prefix is not None else {}
        for k in ("hits", "misses", "collisions", "evictions"):
            out[f"prefix_{k}"] = int(stats.get(k, 0))
        out["poisoned_sequences"] = len(self.poisoned())
        return out

    def poisoned(self) -> list[int]:
        """Sequences that took a non-finite K or V value: their attention outputs are
        NaN until `release` (other sequences are unaffected)."""
        return np.flatnonzero(np.asarray(self.state.poisoned)).tolist()

    def attend(self, q, *, return_selection=False):
        """Decode attention for q [B, Hq, D] -> [B, Hq, D] float32 (one decode step:
        the next step's selection favours this step's pages, `cfg.sticky_nats`)."""
        c = self.cfg
        q = self._check_kv("q", q, (c.max_seqs, c.num_q_heads, c.head_dim))
        out, pages, self.state = decode_step(c, self.state, jnp.asarray(q),
                                             implementation=self.implementation)
        return (out, pages) if return_selection else out
