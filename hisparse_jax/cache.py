"""HiSparseCache: the checked, host-side handle on one layer's cache state.

The pure functions in `state.py` trust their inputs; this class checks every
input before any device work, so a bad call raises and changes nothing. It
mirrors the sequence lengths and the free-page count on the host (both are
determined by the calls made), so checks need no device round trip.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from hisparse_jax import state as st
from hisparse_jax.attention import decode_attention
from hisparse_jax.config import HiSparseConfig

FLOAT_DTYPES = (np.float16, np.float32, jnp.bfloat16)


class CacheFullError(RuntimeError):
    """The cold page pool cannot hold the request; nothing was written."""


class HiSparseCache:
    def __init__(self, cfg: HiSparseConfig, implementation=None):
        self.cfg = cfg
        self.implementation = implementation
        self.state = st.init_state(cfg)
        self.seq_lens = np.zeros(cfg.max_seqs, np.int64)
        self.num_free = cfg.pool_pages

    # ------------------------------------------------------------ checks
    def _check_seq(self, seq: int):
        if not (isinstance(seq, (int, np.integer)) and 0 <= seq < self.cfg.max_seqs):
            raise ValueError(f"seq must be an int in [0, {self.cfg.max_seqs}), got {seq!r}")

    def _check_kv(self, name, x, shape):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")

    def _check_room(self, lengths_after: np.ndarray, lengths_before: np.ndarray):
        if np.any(lengths_after > self.cfg.max_context):
            raise ValueError(f"context {int(lengths_after.max())} exceeds max_context="
                             f"{self.cfg.max_context}")
        need = int(np.sum(st.num_cold_pages(self.cfg, lengths_after)
                          - st.num_cold_pages(self.cfg, lengths_before)))
        if need > self.num_free:
            raise CacheFullError(f"cold page pool full: need {need} pages, {self.num_free} free "
                                 f"of {self.cfg.pool_pages}")
        return need

    # ------------------------------------------------------------ updates
    def prefill(self, seq: int, k, v):
        """Fill empty sequence `seq` with k, v [T, Hkv, D]."""
        self._check_seq(seq)
        c = self.cfg
        k, v = jnp.asarray(k), jnp.asarray(v)
        if k.ndim != 3:
            raise ValueError(f"k must be [T, Hkv, D], got shape {tuple(k.shape)}")
        t = k.shape[0]
        self._check_kv("k", k, (t, c.num_kv_heads, c.head_dim))
        self._check_kv("v", v, (t, c.num_kv_heads, c.head_dim))
        if t == 0:
            raise ValueError("prefill needs at least one token")
        if self.seq_lens[seq]:
            raise ValueError(f"sequence {seq} already holds {self.seq_lens[seq]} tokens; "
                             "prefill fills an empty sequence (use append for more)")
        after = self.seq_lens.copy()
        after[seq] = t
        need = self._check_room(after, self.seq_lens)
        pad = -t % c.page_size
        if pad:
            k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
            v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
        self.state = st.prefill(c, self.state, jnp.int32(seq), k, v, jnp.int32(t))
        self.seq_lens[seq] = t
        self.num_free -= need

    def append(self, k, v, active=None):
        """Append one token to each active sequence: k, v [B, Hkv, D]."""
        c = self.cfg
        self._check_kv("k", k, (c.max_seqs, c.num_kv_heads, c.head_dim))
        self._check_kv("v", v, (c.max_seqs, c.num_kv_heads, c.head_dim))
        active = (np.ones(c.max_seqs, bool) if active is None
                  else np.asarray(active, bool).reshape(c.max_seqs))
        after = self.seq_lens + active
        need = self._check_room(after, self.seq_lens)
        self.state = st.append_token(c, self.state, jnp.asarray(k), jnp.asarray(v),
                                     jnp.asarray(active))
        self.seq_lens = after
        self.num_free -= need

    def release(self, seq: int):
        self._check_seq(seq)
        freed = int(st.num_cold_pages(self.cfg, self.seq_lens[seq]))
        self.state = st.release(self.cfg, self.state, jnp.int32(seq))
        self.seq_lens[seq] = 0
        self.num_free += freed

    # ------------------------------------------------------------ reads
    def attend(self, q, *, return_selection=False):
        """Decode attention for q [B, Hq, D] -> [B, Hq, D] float32."""
        c = self.cfg
        self._check_kv("q", q, (c.max_seqs, c.num_q_heads, c.head_dim))
        return decode_attention(c, self.state, jnp.asarray(q), implementation=self.implementation,
                                return_selection=return_selection)
