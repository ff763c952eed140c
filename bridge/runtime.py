"""The vLLM bridge's engine-independent half: vLLM requests -> HiSparse slots (host
side, `SlotTable`), and one layer's HiSparse cache driven by a step's plan
(`LayerCache`, JAX). Nothing here imports torch or vLLM, so the logic is tested
on its own (tests/bridge/test_bridge_runtime.py) and `vllm_backend.py` only adapts.

How vLLM's requests map onto HiSparse (docs/log/vllm.md, "Requests and slots"):

- A request is known by the first block of its block table (block ids are
  never shared between live requests: prefix caching must be off). A row that
  starts at position 0 is a new request; any slot still holding one of its
  blocks belonged to a finished request and is released first. When vLLM says
  a request finished (the backend reads its scheduler output), `finish`
  releases its slot at once. Failing that, a finished request's slot is
  released when a new request needs a slot and none is free: vLLM schedules
  every running request in every step, so a slot missing from the batch is
  finished (the least recently scheduled one goes).
- Prefill is exact, chunked or not. Until a request decodes, its K/V stay
  exact (bf16) in a staging buffer owned by the layer, and each prefill chunk
  attends the staged prefix and itself causally (`prefix_attention`).
- The first decode step converts: the staged prompt becomes the slot's HiSparse
  state (`hisparse_jax.cache.state.prefill_layer`, every page straight to its tier), the
  staging buffer is dropped, and from then on the slot appends one token per
  step and decodes sparsely (`attention.decode_layer`), all written in place in
  the layer's one-layer stacked state (`state.init_stacked`), as the serving
  engine's layers are.
- Cold pages live in HiSparse's pool at vLLM's block ids: page p of a request is
  stored at pool page `block_table[row, p]` (block size = page size). The
  free-page stack is loaded with exactly those ids before each prefill or
  append, so HiSparse's own allocator is bypassed; a page is only ever read
  after its owner wrote it, so a reused block never shows stale data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import backends
from hisparse_jax.attention import causal_block_attention, decode_layer
from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.cache import layout
from hisparse_jax.cache import state as st
from hisparse_jax.config import (
    FULL_BUDGET,
    HiSparseConfig,
    default_budget_tokens,
    model_preset,
)

log = logging.getLogger("hisparse.bridge")

STAGE, CONVERT, DECODE, MULTI = "stage", "convert", "decode", "multi"


class BridgeError(RuntimeError):
    """vLLM sent a batch the bridge cannot serve (e.g. a prefix-cache hit)."""


# ---------------------------------------------------------------- configuration

# HiSparseConfig fields that come from the model and vLLM's own flags, never from
# HISPARSE_CONFIG: a max_seqs or max_context there would fail requests mid-serving.
FROM_VLLM = ("num_kv_heads", "gqa_group", "head_dim", "page_size", "max_context", "max_seqs",
             "num_pool_pages")


def config_overrides(env=None) -> dict:
    """HiSparseConfig fields from the environment: HISPARSE_CONFIG (a JSON object of
    fields: the tiers, the selection, the budget) and HISPARSE_BUDGET_TOKENS (an int,
    or "all"), which wins. A mistake is a ValueError naming the variable."""
    env = os.environ if env is None else env
    out = {}
    text = env.get("HISPARSE_CONFIG")
    if text:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"HISPARSE_CONFIG={text!r}: not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"HISPARSE_CONFIG={text!r}: must be a JSON object of "
                             "HiSparseConfig fields")
        names = {f.name for f in dataclasses.fields(HiSparseConfig)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"HISPARSE_CONFIG: {', '.join(unknown)}: not HiSparseConfig "
                             "fields")
        fixed = sorted(set(fields) & set(FROM_VLLM))
        if fixed:
            raise ValueError(f"HISPARSE_CONFIG: {', '.join(fixed)}: set by the model and "
                             "vLLM (--max-num-seqs, --max-model-len, --block-size), not here")
        out.update(fields)
    b = env.get("HISPARSE_BUDGET_TOKENS", "").strip()
    if b:
        try:
            out["budget_tokens"] = FULL_BUDGET if b.lower() == "all" else int(b)
        except ValueError:
            raise ValueError(f"HISPARSE_BUDGET_TOKENS={b!r}: an int (cold tokens per KV "
                             "head) or 'all'") from None
    return out


def make_config(*, num_kv_heads: int, num_heads: int, head_dim: int, page_size: int,
                max_model_len: int, max_seqs: int, num_blocks: int | None = None,
                overrides: dict | None = None) -> HiSparseConfig:
    """The HiSparse config of one layer of a vLLM model: what `hisparse serve` runs for
    the same shapes (`config.model_preset`: its tiers and selection, the windows in
    whole blocks) and its decode budget for max_model_len (`default_budget_tokens`)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    fields = {"page_size": page_size, "max_seqs": max_seqs, "num_pool_pages": num_blocks,
              "budget_tokens": default_budget_tokens(max_model_len, page_size),
              **(overrides or {})}
    return model_preset(num_kv_heads=num_kv_heads, gqa_group=num_heads // num_kv_heads,
                        head_dim=head_dim, max_context=max_model_len, **fields)


def bytes_per_token_per_head(cfg: HiSparseConfig) -> float:
    """Device bytes per token per KV head of a sequence of max_context tokens: what
    vLLM's block pool is sized by (`customize_spec`); the per-sequence tiers are
    amortized over the full context."""
    b = layout.sequence_bytes(cfg, cfg.max_context)
    return b.device / (cfg.max_context * cfg.num_kv_heads)


def vllm_content_bytes(cfg: HiSparseConfig) -> int:
    """`bytes_per_token_per_head` rounded up to an even int: the state_content_bytes
    vLLM sizes its pool with (it views the pool in the 2-byte model dtype)."""
    return int(-(-bytes_per_token_per_head(cfg) // 2) * 2)


def predicted_capacity_factor(cfg: HiSparseConfig, dtype_bytes: int = 2,
                              content_bytes: int | None = None) -> float:
    """vLLM's KV capacity in tokens with HiSparse over its own (bf16 K and V,
    2 * head_dim * dtype_bytes per token per KV head), at the same memory; at
    `content_bytes` per (token, KV head) if given, else `vllm_content_bytes`."""
    return 2 * cfg.head_dim * dtype_bytes / (content_bytes or vllm_content_bytes(cfg))


# ---------------------------------------------------------------- the slots and the budget
#
# A layer's state is linear in its slots and pool pages: every slot has its own bf16
# (sink, hot) and fp8 (warm) tiers and a page-table row, whatever the pool size, and
# vLLM's block pool (one page per block) is sized by bytes per token. The functions
# below keep max_seqs slots inside what vLLM allocates.

def state_parts(cfg: HiSparseConfig) -> tuple[int, int, int]:
    """(per slot, per pool page, fixed) device bytes of one layer's state:
    `layout.state_bytes` = max_seqs * slot + pool_pages * page + fixed."""
    def dev(seqs, pages):
        return layout.state_bytes(cfg.replace(max_seqs=seqs, num_pool_pages=pages)).device
    base = dev(1, 1)
    slot, page = dev(2, 1) - base, dev(1, 2) - base
    return slot, page, base - slot - page


def slots_fit(cfg: HiSparseConfig, num_blocks: int, content_bytes: int) -> bool:
    """Whether a layer's state of max_seqs slots and a num_blocks-page pool fits in the
    layer's num_blocks blocks that vLLM allocates at content_bytes per (token, KV
    head) (every layer alike)."""
    slot, page, fixed = state_parts(cfg)
    block = cfg.page_size * cfg.num_kv_heads * content_bytes
    return cfg.max_seqs * slot + num_blocks * page + fixed <= num_blocks * block


def budget_content_bytes(cfg: HiSparseConfig, budget: int, num_layers: int) -> int | None:
    """The smallest even bytes per (token, KV head) at which vLLM's block pool, sized
    from `budget` bytes over num_layers layers (blocks = budget // bytes per block),
    also pays for the max_seqs slots' tiers (`slots_fit`); None if what is left cannot
    hold one max_context sequence (plus vLLM's null block)."""
    slot, page, fixed = state_parts(cfg)
    per_block_byte = num_layers * cfg.page_size * cfg.num_kv_heads  # bytes per block / c
    one_seq = cfg.max_pages + 1
    most = (budget // num_layers - cfg.max_seqs * slot - fixed) // page  # most pool pages
    if most < one_seq:
        return None
    c = max(-(-page // (cfg.page_size * cfg.num_kv_heads)),
            -(-budget // (per_block_byte * most)))
    c += c % 2
    while True:  # at most a few steps: the floors can leave a block short
        blocks = budget // (per_block_byte * c)
        if blocks < one_seq:
            return None
        if slots_fit(cfg, blocks, c):
            return c
        c += 2


def max_seqs_within(cfg: HiSparseConfig, fits) -> int:
    """The largest max_seqs in [0, cfg.max_seqs] for which fits(cfg) holds (it
    holds for fewer slots if for more)."""
    lo, hi = 0, cfg.max_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(cfg.replace(max_seqs=mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------- host side: the plan

@dataclasses.dataclass
class ReqPlan:
    row: int                 # request index in vLLM's batch
    slot: int
    start: int               # its first token row
    n: int                   # query tokens this step
    ctx: int                 # tokens cached before this step
    kind: str                # STAGE | CONVERT | DECODE | MULTI
    prefill_ids: np.ndarray | None = None   # CONVERT: pool ids of the ctx tokens' cold pages
    token_ids: list | None = None           # MULTI: (pool id or -1) per token


@dataclasses.dataclass
class StepPlan:
    num_tokens: int
    releases: list[int]
    reqs: list[ReqPlan]
    dec_slots: np.ndarray    # [max_seqs] int32: slots of DECODE/CONVERT rows, padded with -1
    dec_rows: np.ndarray     # [max_seqs] int32: their token rows, padded with 0
    dec_n: int
    dec_ids: np.ndarray      # [max_seqs] int32: pool ids in the order append_token pops them
    dec_n_ids: int


def append_pool_id(cfg: HiSparseConfig, pos: int, blocks: np.ndarray) -> int:
    """The pool page a token at `pos` makes cold when appended (-1: none). When a
    token opens page `pos // page`, page `pos // page - hot - warm` turns cold."""
    pg = cfg.page_size
    if pos % pg:
        return -1
    cold = pos // pg - cfg.hot_pages - cfg.warm_pages
    return int(blocks[cold]) if cold >= cfg.sink_pages else -1


def prefill_pool_ids(cfg: HiSparseConfig, length: int, blocks: np.ndarray) -> np.ndarray:
    """Pool pages of a `length`-token prefill's cold pages, in the order it pops them."""
    n = int(st.num_cold_pages(cfg, length))
    return np.asarray(blocks[cfg.sink_pages:cfg.sink_pages + n], np.int32)


class SlotTable:
    """Which HiSparse slot holds which vLLM request; one per engine process, shared
    by every layer (the plan is made once per step, in the metadata builder)."""

    def __init__(self, cfg: HiSparseConfig, exact: bool = False):
        self.cfg = cfg
        self.exact = exact  # never convert: every step attends the staged exact K/V
        b = cfg.max_seqs
        self.key = np.full(b, -1, np.int64)        # first block id of the owner, -1 = free
        self.length = np.zeros(b, np.int64)        # tokens cached (staged or in HiSparse)
        self.sparse = np.zeros(b, bool)            # converted to HiSparse
        self.last_step = np.full(b, -1, np.int64)
        self.blocks: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(b)]
        self.owner: dict[int, int] = {}            # block id -> slot
        self.step = 0
        self.counters = {"requests": 0, "released_stale": 0, "evicted_lru": 0,
                         "released_finished": 0, "converted": 0, "decode_tokens": 0,
                         "prefill_tokens": 0, "multi_tokens": 0}

    def _release(self, s: int, releases: list[int]):
        for b in self.blocks[s]:
            if self.owner.get(int(b)) == s:
                del self.owner[int(b)]
        self.key[s] = -1
        self.length[s] = 0
        self.sparse[s] = False
        self.blocks[s] = np.zeros(0, np.int64)
        releases.append(s)

    def finish(self, first_block: int) -> int | None:
        """vLLM says the request whose first block is `first_block` finished (or was
        aborted or preempted): release its slot now. Returns the slot, or None if
        no slot holds it (it never ran, or its slot went already)."""
        found = np.flatnonzero(self.key == first_block)
        if not found.size:
            return None
        s = int(found[0])
        self._release(s, [])
        self.counters["released_finished"] += 1
        return s

    def in_use(self) -> int:
        return int(np.count_nonzero(self.key >= 0))

    def _claim(self, s: int, blocks: np.ndarray, busy: set, releases: list[int]):
        """Record that slot s holds `blocks`; a slot that held one of them is dead."""
        for b in blocks.tolist():
            o = self.owner.get(b)
            if o is not None and o != s:
                if o in busy:
                    raise BridgeError(f"block {b} is in two live requests (slots {o} and {s}); "
                                      "the HiSparse bridge needs prefix caching off "
                                      "(--no-enable-prefix-caching)")
                self.counters["released_stale"] += 1
                self._release(o, releases)
            self.owner[b] = s
        self.blocks[s] = blocks

    def plan(self, query_start_loc, seq_lens, block_table, num_reqs: int, num_tokens: int,
             is_prefilling=None) -> StepPlan:
        """The step's actions. query_start_loc [>= num_reqs + 1], seq_lens [>= num_reqs]
        (context including this step's tokens), block_table [>= num_reqs, W]: numpy
        int arrays (vLLM's CPU copies). Updates the table as if the step ran."""
        cfg, pg = self.cfg, self.cfg.page_size
        self.step += 1
        qsl = np.asarray(query_start_loc, np.int64)
        sl = np.asarray(seq_lens, np.int64)
        bt = np.asarray(block_table)
        releases: list[int] = []
        reqs: list[ReqPlan] = []
        rows = [i for i in range(num_reqs) if qsl[i + 1] > qsl[i]]
        firsts = {int(bt[i, 0]) for i in rows}
        busy: set[int] = set()
        dec: list[tuple[int, int, int]] = []  # (slot, token row, pool id)
        # Pass 1: find or allocate every request's slot.
        placed = []
        for i in rows:
            n, length = int(qsl[i + 1] - qsl[i]), int(sl[i])
            ctx = length - n
            first = int(bt[i, 0])
            if length > cfg.max_context:
                raise BridgeError(f"request of {length} tokens exceeds max_context "
                                  f"{cfg.max_context}")
            found = np.flatnonzero(self.key == first)
            if ctx == 0:
                for s in found:  # a finished request whose first block came back
                    self.counters["released_stale"] += 1
                    self._release(int(s), releases)
                s = None
            else:
                if not found.size:
                    raise BridgeError(
                        f"a request continues at position {ctx} but this process never saw "
                        "its start (a prefix-cache hit?); the HiSparse bridge needs prefix "
                        "caching off (--no-enable-prefix-caching)")
                s = int(found[0])
                if self.length[s] != ctx:
                    raise BridgeError(f"slot {s} holds {self.length[s]} tokens but vLLM "
                                      f"resumes it at {ctx}")
            placed.append((i, n, length, ctx, s))
            if s is not None:
                busy.add(s)
        for k, (i, n, length, ctx, s) in enumerate(placed):
            if s is not None:
                continue
            free = np.flatnonzero(self.key < 0)
            if free.size:
                s = int(free[0])
            else:  # every slot is taken: the least recently scheduled one is finished
                cand = [j for j in range(cfg.max_seqs) if j not in busy
                        and int(self.key[j]) not in firsts]
                if not cand:
                    raise BridgeError(f"more than max_seqs={cfg.max_seqs} requests in one "
                                      "batch")
                # vLLM's scheduler runs every running request in every step (decodes
                # first; a preempted one frees its blocks and restarts at 0), so a
                # slot missing from this batch belongs to a finished request.
                s = min(cand, key=lambda j: self.last_step[j])
                self.counters["evicted_lru"] += 1
                log.debug("HiSparse bridge: no free slot; releasing slot %d (last "
                          "scheduled %d steps ago)", s, self.step - self.last_step[s])
                self._release(s, releases)
            self.key[s] = int(bt[i, 0])
            self.counters["requests"] += 1
            busy.add(s)
            placed[k] = (i, n, length, ctx, s)
        # Pass 2: blocks, kinds, pool ids.
        for i, n, length, ctx, s in placed:
            blocks = np.asarray(bt[i, :-(-length // pg)], np.int64)
            self._claim(s, blocks, busy, releases)
            self.last_step[s] = self.step
            start = int(qsl[i])
            prefilling = None if is_prefilling is None else bool(is_prefilling[i])
            if not self.sparse[s]:
                if n == 1 and ctx > 0 and prefilling is not True and not self.exact:
                    r = ReqPlan(i, s, start, n, ctx, CONVERT,
                                prefill_ids=prefill_pool_ids(cfg, ctx, blocks))
                    dec.append((s, start, append_pool_id(cfg, ctx, blocks)))
                    self.sparse[s] = True
                    self.counters["converted"] += 1
                    self.counters["decode_tokens"] += 1
                else:
                    r = ReqPlan(i, s, start, n, ctx, STAGE)
                    self.counters["prefill_tokens"] += n
            elif n == 1:
                r = ReqPlan(i, s, start, n, ctx, DECODE)
                dec.append((s, start, append_pool_id(cfg, ctx, blocks)))
                self.counters["decode_tokens"] += 1
            else:
                r = ReqPlan(i, s, start, n, ctx, MULTI,
                            token_ids=[append_pool_id(cfg, ctx + j, blocks) for j in range(n)])
                self.counters["multi_tokens"] += n
            self.length[s] = length
            reqs.append(r)
        b = cfg.max_seqs
        dec.sort()  # append_token pops pool pages in slot order
        dec_slots = np.full(b, -1, np.int32)
        dec_rows = np.zeros(b, np.int32)
        dec_ids = np.zeros(b, np.int32)
        ids = [p for _, _, p in dec if p >= 0]
        for j, (s, row, _) in enumerate(dec):
            dec_slots[j], dec_rows[j] = s, row
        dec_ids[:len(ids)] = ids
        return StepPlan(num_tokens, releases, reqs, dec_slots, dec_rows, len(dec), dec_ids,
                        len(ids))


# ---------------------------------------------------------------- device side: jitted pieces

# Each layer's state is kept layer-stacked (one layer, `state.init_stacked`), the form
# whose writes XLA does in place: a step on a plain state, wrapped into that form and
# back inside the program, copied the whole pool several times (docs/log/vllm.md,
# "The decode step in place").

def _load_free_stack(cfg: HiSparseConfig, stacked: st.CacheState, ids, n):
    """Make the next n pops of the free-page stack return ids[0], ids[1], ..."""
    r = jnp.arange(ids.shape[0])
    pos = jnp.where(r < n, n - 1 - r, cfg.pool_pages)
    return stacked.replace(free_pages=stacked.free_pages.at[0, pos].set(ids, mode="drop"),
                           num_free=stacked.num_free.at[0].set(n))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def prefill_at(cfg: HiSparseConfig, stacked: st.CacheState, seq, k, v, length, ids, n_ids):
    """`state.prefill` of the empty slot `seq` whose cold pages go to pool pages `ids`."""
    stacked = _load_free_stack(cfg, stacked, ids, n_ids)
    return st.prefill_layer(cfg, stacked, jnp.int32(0), seq, k, v, length,
                            release_first=False)[0]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def release_slot(cfg: HiSparseConfig, stacked: st.CacheState, seq):
    return st.release_layer(cfg, stacked, 0, seq)


@functools.partial(jax.jit, static_argnums=0, static_argnames="width", donate_argnums=1)
def decode_rows(cfg: HiSparseConfig, stacked: st.CacheState, q, k, v, slots, ids, n_ids,
                q_scale, *, width: int | None = None):
    """Append one token to each listed slot and decode it sparsely.

    q [R, Hq, D], k, v [R, Hkv, D] (R = max_seqs rows; rows whose slot is -1 are
    padding); slots [R] int32; ids [R] int32: pool pages for the pages that turn
    cold, in slot order. Returns (out [R, Hq, D] float32, stacked). Slots not listed
    keep their selection memory (`last_selected`) untouched. width: compute slots
    0..width-1 only (`state.decode_width`; every listed slot must be below it):
    their tiers are copied out and back (not the window's on the "cpu" kernels,
    which read them in place), the pool stays in place.
    """
    stacked = _load_free_stack(cfg, stacked, ids, n_ids)
    keep = backends.reads_in_place("attend_cold", resolve_implementation(None, cfg))
    part_cfg, part = st.first_slots(cfg, stacked, width or cfg.max_seqs, axis=1, keep=keep)
    out, part = _decode_rows(part_cfg, part, q, k, v, slots, q_scale)
    return out, st.put_first_slots(stacked, part, axis=1)


def _decode_rows(cfg, stacked, q, k, v, slots, q_scale):
    b = cfg.max_seqs
    sl = jnp.where(slots >= 0, slots, b)
    active = jnp.zeros((b,), bool).at[sl].set(True, mode="drop")

    def scatter(x):
        return jnp.zeros((b, *x.shape[1:]), jnp.float32).at[sl].set(
            x.astype(jnp.float32), mode="drop")

    held = stacked.last_selected[0]
    out, stacked = decode_layer(cfg, stacked, jnp.int32(0), scatter(q) * q_scale,
                                scatter(k), scatter(v), active)
    kept = jnp.where(active[:, None, None], stacked.last_selected[0], held)
    return (out[jnp.clip(slots, 0, b - 1)],
            stacked.replace(last_selected=stacked.last_selected.at[0].set(kept)))


@functools.partial(jax.jit, static_argnames=("chunk",))
def causal_attention(q, k, v, scale, *, chunk: int = PREFILL_CHUNK):
    """Exact causal attention of a prompt from position 0 (q [T, Hq, D], k, v
    [T, Hkv, D], T a multiple of `chunk`) with softmax scale `scale`: the engine's
    exact prefill (`attention.causal_block_attention` in XLA), q rescaled for its
    1/sqrt(D)."""
    d = q.shape[-1]
    return causal_block_attention(q.astype(jnp.float32) * (scale * math.sqrt(d)), k, v, 0,
                                  chunk, "xla")


@functools.partial(jax.jit, static_argnames=("block",))
def prefix_attention(q, k, v, ctx, kv_len, scale, *, block: int = 128):
    """Exact attention of queries at positions ctx, ctx+1, ... over keys [0, kv_len)
    (causal: query i sees keys <= ctx + i).

    q [Nq, Hq, D] (Nq a multiple of `block`), k, v [S, Hkv, D] -> [Nq, Hq, D] f32.
    Memory is O(block * S) per head.
    """
    nq, hq, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    qb = q.astype(jnp.float32).reshape(nq // block, block, hkv, g, d)
    key_pos = jnp.arange(s)

    def one(args):
        i, qi = args
        logits = jnp.einsum("qhgd,khd->hgqk", qi, kf) * scale
        qpos = ctx + i * block + jnp.arange(block)
        ok = (key_pos[None, :] <= qpos[:, None]) & (key_pos[None, :] < kv_len)
        logits = jnp.where(ok, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        o = jnp.einsum("hgqk,khd->qhgd", p, vf)
        return o.reshape(block, hq, d)

    out = jax.lax.map(one, (jnp.arange(nq // block), qb))
    return out.reshape(nq, hq, d)


def jax_exact_attention(q, kbuf, vbuf, ctx: int, n: int, scale: float):
    """Exact causal attention in JAX (LayerCache's default): q [nb, Hq, D] at
    positions ctx.. over kbuf, vbuf [cap, Hkv, D] rows [0, ctx + n)."""
    if ctx == 0:
        t = bucket(n, PREFILL_CHUNK)
        if t > kbuf.shape[0]:  # cannot happen: the buffer is at least this long
            raise AssertionError((t, kbuf.shape))
        q = jnp.pad(q, ((0, t - q.shape[0]), (0, 0), (0, 0)))
        return causal_attention(q, kbuf[:t], vbuf[:t], jnp.float32(scale))
    nb = q.shape[0]
    qb = bucket(nb, 128) if nb > 16 else nb
    if qb != nb:
        q = jnp.pad(q, ((0, qb - nb), (0, 0), (0, 0)))
    return prefix_attention(q, kbuf, vbuf, jnp.int32(ctx), jnp.int32(ctx + n),
                            jnp.float32(scale), block=min(128, qb))


def bucket(n: int, lo: int) -> int:
    """n rounded up to a power of two >= lo (static shapes: few compilations)."""
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# ---------------------------------------------------------------- one layer

@functools.partial(jax.jit, donate_argnums=(0, 1))
def _stage_write(kbuf, vbuf, k, v, at):
    """Write a chunk (k, v [n, Hkv, D]) into staging buffers [cap, Hkv, D] at row `at`."""
    z = jnp.int32(0)
    return (jax.lax.dynamic_update_slice(kbuf, k.astype(kbuf.dtype), (at, z, z)),
            jax.lax.dynamic_update_slice(vbuf, v.astype(vbuf.dtype), (at, z, z)))


class LayerCache:
    """One layer: its HiSparse state (`CacheState`, the cold pool indexed by vLLM's
    block ids) and the exact staging buffers of requests still in prefill, driven
    by StepPlans.

    `step(plan, batch)` reads the step's tokens through `batch` (see `ArrayBatch`):
    `batch.rows(start, n, pad)` gives (q, k, v) of rows start..start+n zero-padded
    to `pad` rows, `batch.gather(rows)` gives the listed rows; JAX arrays. It
    returns the outputs as [("range", start, n, out), ("rows", rows, out)], out
    float32 [>= n, Hq, D]; the caller writes them into vLLM's output.
    """

    def __init__(self, cfg: HiSparseConfig, scale: float, exact_attention=None):
        self.cfg = cfg
        self.scale = float(scale)
        self.q_scale = jnp.float32(self.scale * math.sqrt(cfg.head_dim))
        self.stacked = st.init_stacked(cfg, 1)  # this layer's state (see prefill_at)
        self.staged: dict[int, tuple] = {}  # slot -> (kbuf, vbuf) [cap, Hkv, D]
        # (q [>= n, Hq, D], kbuf, vbuf, ctx, n, scale) -> [>= n, Hq, D]: exact causal
        # attention of n queries at positions ctx.. over staged keys [0, ctx + n).
        self.exact_attention = exact_attention or jax_exact_attention

    @property
    def state(self) -> st.CacheState:
        """The layer's state (a copy: for reading)."""
        return st.layer_view(self.cfg, self.stacked, 0)

    # -- pieces
    def release(self, slot: int):
        self.staged.pop(slot, None)
        self.stacked = release_slot(self.cfg, self.stacked, jnp.int32(slot))

    def _stage(self, r: ReqPlan, batch):
        """Stage a prefill chunk's K/V; exact attention over the prefix and itself."""
        nb = bucket(r.n, 16)
        q, k, v = batch.rows(r.start, r.n, nb)
        if r.ctx == 0:
            cap = bucket(r.n, PREFILL_CHUNK)
            kbuf = jnp.zeros((cap, *k.shape[1:]), k.dtype)
            vbuf = jnp.zeros((cap, *v.shape[1:]), v.dtype)
        else:
            kbuf, vbuf = self.staged[r.slot]
        need = r.ctx + nb
        if need > kbuf.shape[0]:  # grow (power-of-two capacities)
            cap = max(bucket(need, PREFILL_CHUNK), 2 * kbuf.shape[0])
            kbuf = jnp.zeros((cap, *kbuf.shape[1:]), kbuf.dtype).at[:kbuf.shape[0]].set(kbuf)
            vbuf = jnp.zeros((cap, *vbuf.shape[1:]), vbuf.dtype).at[:vbuf.shape[0]].set(vbuf)
        kbuf, vbuf = _stage_write(kbuf, vbuf, k, v, jnp.int32(r.ctx))
        self.staged[r.slot] = (kbuf, vbuf)
        return self.exact_attention(q, kbuf, vbuf, r.ctx, r.n, self.scale)

    def _convert(self, r: ReqPlan):
        kbuf, vbuf = self.staged.pop(r.slot)
        ids = np.zeros(self.cfg.max_pages, np.int32)
        ids[:len(r.prefill_ids)] = r.prefill_ids
        self.stacked = prefill_at(self.cfg, self.stacked, jnp.int32(r.slot), kbuf, vbuf,
                                  jnp.int32(r.ctx), jnp.asarray(ids),
                                  jnp.int32(len(r.prefill_ids)))

    def _decode(self, q, k, v, slots, ids, n_ids):
        # only the slots up to the highest listed one (SlotTable takes the lowest free)
        width = st.decode_width(self.cfg.max_seqs, int(np.max(slots)) + 1)
        out, self.stacked = decode_rows(self.cfg, self.stacked, q, k, v, jnp.asarray(slots),
                                        jnp.asarray(ids), jnp.int32(n_ids), self.q_scale,
                                        width=width)
        return out

    # -- a whole step
    def step(self, plan: StepPlan, batch) -> list:
        cfg = self.cfg
        results = []
        for s in plan.releases:
            self.release(s)
        for r in plan.reqs:
            if r.kind == STAGE:
                results.append(("range", r.start, r.n, self._stage(r, batch)))
        for r in plan.reqs:
            if r.kind == CONVERT:
                self._convert(r)
        if plan.dec_n:
            q, k, v = batch.gather(plan.dec_rows)
            out = self._decode(q, k, v, plan.dec_slots, plan.dec_ids, plan.dec_n_ids)
            results.append(("rows", plan.dec_rows[:plan.dec_n], out))
        for r in plan.reqs:
            if r.kind != MULTI:
                continue
            for j in range(r.n):  # one token at a time, each a decode step
                rows = np.zeros(cfg.max_seqs, np.int32)
                rows[0] = r.start + j
                slots = np.full(cfg.max_seqs, -1, np.int32)
                slots[0] = r.slot
                p = r.token_ids[j]
                ids = np.zeros(cfg.max_seqs, np.int32)
                ids[0] = max(p, 0)
                q, k, v = batch.gather(rows)
                out = self._decode(q, k, v, slots, ids, int(p >= 0))
                results.append(("rows", rows[:1], out))
        # vLLM reuses its q/k/v buffers after we return: nothing may still read them.
        jax.block_until_ready((self.stacked, self.staged, [x[-1] for x in results]))
        return results

    def nbytes(self) -> int:
        """Bytes of the HiSparse state plus the staging buffers held now."""
        return layout.nbytes(self.stacked) + layout.nbytes(self.staged)


class ArrayBatch:
    """A step's tokens as arrays (q [T, Hq, D], k, v [T, Hkv, D]; numpy or JAX), for
    tests and for callers outside vLLM."""

    def __init__(self, q, k, v):
        self.q, self.k, self.v = q, k, v

    def rows(self, start, n, pad):
        def one(x):
            x = jnp.asarray(x[start:start + n])
            return jnp.pad(x, ((0, pad - n), (0, 0), (0, 0)))
        return one(self.q), one(self.k), one(self.v)

    def gather(self, rows):
        rows = np.asarray(rows)
        return tuple(jnp.asarray(np.asarray(x)[rows]) for x in (self.q, self.k, self.v))


def scatter_results(results, num_tokens: int, num_heads: int, head_dim: int) -> np.ndarray:
    """The step's outputs as one [T, Hq, D] float32 numpy array (tests)."""
    out = np.zeros((num_tokens, num_heads, head_dim), np.float32)
    for kind, a, b, *rest in results:
        if kind == "range":
            out[a:a + b] = np.asarray(rest[0][:b])
        else:
            out[np.asarray(a)] = np.asarray(b)[:len(a)]
    return out
