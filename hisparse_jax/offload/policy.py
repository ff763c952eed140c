"""Residency scheduler for offload mode (DESIGN §2.3): which cold pages stay on the
device.

In offload mode the int4 codes of cold pages live in host memory; the device
keeps a working set of W resident cold pages per (sequence, KV head). Each decode
step the selection (`attention.select_pages`) names K pages per (sequence, KV
head); selected pages that are not resident are fetched (misses), the rest never
cross the bus. The scheduler decides what to keep and what to prefetch.

Everything here is a pure, jitted function of an immutable `SchedulerState`:

    p = plan(state, selected, candidates=..., prev_layer_selected=...)
    # host side: copy p.fetch pages into their slots (p.fetch[b, h, slot] = page)
    state = apply(state, p)

`plan` never drops a selected page: after `apply` every selected page is
resident (K <= W is required). Two policies share the interface:

- "predictive": keep = selected pages, then pages predicted for the next step,
  then the rest by a recency-weighted selection frequency
  (score <- decay * score + [selected]). Predictions for step t+1 are the pages
  of the layer below at step t+1 (`prev_layer_selected`, known one layer ahead of
  need) and the runner-up pages of step t's scores (`candidates`: a wider top-k of
  the same digest scores, free to compute). Up to `max_prefetch` predicted pages
  that are not resident are prefetched: by default only the layer below's (the
  runner-ups then only protect resident pages; prefetching them too bought little
  hit rate for many bytes, see docs/log/scheduler.md).
- "lru": keep = selected pages, then the most recently selected; demand fetch only.

Counters (int32, summed over sequences and heads): selected, hits (selected and
already resident), misses, fetched (misses + prefetched), prefetched, evictions.
Host->device bytes = fetched x `page_bytes(cfg)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hisparse_jax.cache import layout
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.validate import check_int, is_int, is_number

COUNTERS = ("selected", "hits", "misses", "fetched", "prefetched", "evictions")
POLICIES = ("predictive", "lru")


@dataclasses.dataclass(frozen=True)
class Policy:
    kind: str = "predictive"
    decay: float = 0.8          # score <- decay * score + [selected]
    max_prefetch: int = 32      # new pages prefetched per (sequence, KV head) per step
    # Runner-up pages (`candidates`) are fetched ahead when True; when False they only
    # protect resident pages from eviction (the layer below's pages are fetched).
    prefetch_candidates: bool = False

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"Policy.kind must be one of {POLICIES}, got {self.kind!r}")
        if not (is_number(self.decay) and 0.0 <= self.decay < 1.0):
            raise ValueError(f"Policy.decay must be a number in [0, 1), got {self.decay!r}")
        if not (is_int(self.max_prefetch) and self.max_prefetch >= 0):
            raise ValueError(f"Policy.max_prefetch must be an int >= 0, got {self.max_prefetch!r}")
        if not isinstance(self.prefetch_candidates, bool):
            raise ValueError(f"Policy.prefetch_candidates must be a bool, got "  # noqa: TRY004
                             f"{self.prefetch_candidates!r}")
        object.__setattr__(self, "decay", float(self.decay))
        object.__setattr__(self, "max_prefetch", int(self.max_prefetch))


LRU = Policy(kind="lru", max_prefetch=0)


@struct.dataclass
class SchedulerState:
    resident: jax.Array    # [B, Hkv, W] int32: logical page held by each slot, -1 empty
    score: jax.Array       # [B, Hkv, W] f32: recency-weighted selection frequency
    last_used: jax.Array   # [B, Hkv, W] int32: step the slot's page was last selected/fetched
    step: jax.Array        # [] int32
    counters: jax.Array    # [len(COUNTERS)] int32
    policy: Policy = struct.field(pytree_node=False, default=Policy())


@struct.dataclass
class Plan:
    fetch: jax.Array       # [B, Hkv, W] int32: page to copy into slot w this step, -1 = none
    evict: jax.Array       # [B, Hkv, W] int32: page leaving slot w, -1 = none
    predicted: jax.Array   # [B, Hkv, K + C] int32: pages expected at step t+1, -1 padded
    hit: jax.Array         # [B, Hkv, K] bool: selected page was already resident
    resident: jax.Array    # [B, Hkv, W] the working set after apply
    score: jax.Array
    last_used: jax.Array
    delta: jax.Array       # [len(COUNTERS)] int32 counter increments


def init_state(batch: int, num_kv_heads: int, working_set: int,
               policy: Policy = Policy()) -> SchedulerState:
    batch = check_int("batch", batch, minimum=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
    working_set = check_int("working_set", working_set, minimum=1)
    if not isinstance(policy, Policy):
        raise ValueError(f"policy must be a scheduler.Policy, got {policy!r}")  # noqa: TRY004
    shape = (batch, num_kv_heads, working_set)
    return SchedulerState(resident=jnp.full(shape, -1, jnp.int32),
                          score=jnp.zeros(shape, jnp.float32),
                          last_used=jnp.full(shape, -1, jnp.int32),
                          step=jnp.zeros((), jnp.int32),
                          counters=jnp.zeros((len(COUNTERS),), jnp.int32), policy=policy)


def page_bytes(cfg: HiSparseConfig) -> int:
    """Bytes of one cold page of one KV head that cross the bus (int4 K/V + V scales)."""
    codes, _ = layout.per_page_cold_bytes(cfg)
    return codes // cfg.num_kv_heads


def working_set_bytes(cfg: HiSparseConfig, working_set: int, batch: int = 1) -> int:
    """Device bytes of the working set of `batch` sequences, one layer, all KV heads:
    the resident page data, the buffer for the step's sampled pages
    (`cfg.sample_pages`) and this module's state (equal to nbytes(init_state))."""
    data = batch * cfg.num_kv_heads * (working_set + cfg.sample_pages) * page_bytes(cfg)
    per_slot = layout.I32 + layout.F32 + layout.I32     # resident, score, last_used
    meta = batch * cfg.num_kv_heads * working_set * per_slot + layout.I32 \
        + len(COUNTERS) * layout.I32
    return data + meta


def counters(state: SchedulerState, cfg: HiSparseConfig | None = None,
             since: np.ndarray | None = None) -> dict:
    """The counters as ints (`since`: [len(COUNTERS)] counts already taken out of
    the int32 device counters, added), bytes, hit rate."""
    values = np.asarray(state.counters).astype(np.int64)
    if since is not None:
        values = values + since
    c = dict(zip(COUNTERS, (int(x) for x in values)))
    if cfg is not None:
        c["host_to_device_bytes"] = c["fetched"] * page_bytes(cfg)
    c["hit_rate"] = c["hits"] / max(1, c["selected"])
    return c


# ---------------------------------------------------------------- the policy

def _member(x, pool):
    """x [N] in pool [M] (both int32, -1 never matches) -> [N] bool."""
    return jnp.any((x[:, None] == pool[None, :]) & (pool[None, :] >= 0), axis=1) & (x >= 0)


def _dedup(x):
    """Replace repeats (after their first occurrence) and negatives by -1."""
    earlier = jnp.tril(x[:, None] == x[None, :], k=-1)
    return jnp.where(jnp.any(earlier, axis=1) | (x < 0), -1, x)


def _plan_row(policy: Policy, step, res, score, last, sel, pred, n_fetchable=None,
              between_steps=False):
    """One (sequence, KV head). res/score/last [W], sel [K], pred [C] (ordered by
    preference; only the first n_fetchable may be fetched, the rest only protect
    resident pages). between_steps: a prefetch before this step's selection (sel
    is empty): the last step's selection stays protected and nothing decays.
    Returns the row's plan fields."""
    W, K = res.shape[0], sel.shape[0]
    sel = _dedup(sel)
    valid_res = res >= 0
    res_sel = _member(res, sel)                      # [W] resident and selected
    if between_steps:
        res_sel = valid_res & (last == step - 1)     # protected as if selected now
    hit = _member(sel, res)                          # [K]
    missed = jnp.where((sel >= 0) & ~hit, sel, -1)   # [K] must be fetched
    if not between_steps:
        score = jnp.where(valid_res, policy.decay * score + res_sel, 0.0)
        last = jnp.where(res_sel, step, last)

    if policy.kind == "predictive":
        pred = _dedup(pred)
        pred = jnp.where(_member(pred, sel), -1, pred)   # selected pages are kept anyway
        res_pred = _member(res, pred)                    # [W] resident and predicted
        new_pred = jnp.where(_member(pred, res), -1, pred)
        if n_fetchable is not None:
            new_pred = jnp.where(jnp.arange(pred.shape[0]) < n_fetchable, new_pred, -1)
        rank = jnp.cumsum(new_pred >= 0) - 1             # preference order among new ones
        new_pred = jnp.where(rank < policy.max_prefetch, new_pred, -1)
        c = max(1, new_pred.shape[0])
        # Tiers: 3 selected, 2.5-3 resident predicted, 2-2.5 new predicted, 1-2 the rest.
        keep_old = 1.0 + 0.9 * score * (1.0 - policy.decay) \
            + 0.1 * (last + 1) / (step + 1.0)
        keep_old = jnp.where(res_pred, 2.75, keep_old)
        pr_pred = jnp.where(new_pred >= 0, 2.5 - 0.5 * jnp.arange(new_pred.shape[0]) / c,
                            -jnp.inf)
    else:
        new_pred = jnp.full((0,), -1, jnp.int32)
        keep_old = 1.0 + (last + 1) / (step + 1.0)       # LRU: most recently used first
        pr_pred = jnp.zeros((0,), jnp.float32)
    keep_old = jnp.where(res_sel, 3.0, keep_old)
    keep_old = jnp.where(valid_res, keep_old, -jnp.inf)
    pr_miss = jnp.where(missed >= 0, 3.0, -jnp.inf)

    prio = jnp.concatenate([keep_old, pr_miss, pr_pred])
    top, idx = jax.lax.top_k(prio, W)
    chosen = jnp.zeros(prio.shape, bool).at[idx].set(top > -jnp.inf)
    kept = chosen[:W]
    new_ids = jnp.concatenate([missed, new_pred])
    new_chosen = chosen[W:]
    is_pref = jnp.concatenate([jnp.zeros(K, bool), jnp.ones(new_pred.shape[0], bool)])
    # Compact the chosen new pages and drop them into the freed slots in order.
    order = jnp.argsort(~new_chosen, stable=True)
    n = min(new_ids.shape[0], W)
    vals = jnp.where(new_chosen[order], new_ids[order], -1)[:n]
    vals_pref = is_pref[order][:n]
    free = jnp.argsort(kept, stable=True)[:n]        # not-kept slots first
    base = jnp.where(kept, res, -1)
    # Chosen new pages come first in `vals` and never outnumber the free slots; the
    # -1 tail may reach kept slots, which keep their page.
    new_res = base.at[free].set(jnp.where(vals >= 0, vals, base[free]))
    fetched = jnp.zeros(W, bool).at[free].set(vals >= 0)
    fetch = jnp.where(fetched, new_res, -1)
    evict = jnp.where(valid_res & ~kept, res, -1)
    pref_slot = jnp.zeros(W, bool).at[free].set((vals >= 0) & vals_pref)
    new_score = jnp.where(kept, score, 0.0)
    new_score = jnp.where(fetched & ~pref_slot, 1.0, new_score)   # demand: selected now
    new_last = jnp.where(kept, last, -1)
    new_last = jnp.where(fetched, step, new_last)
    n_sel = jnp.sum(sel >= 0)
    n_hit = jnp.sum(hit)
    n_fetch = jnp.sum(fetched)
    n_pref = jnp.sum(pref_slot)
    delta = jnp.stack([n_sel, n_hit, n_sel - n_hit, n_fetch, n_pref,
                       jnp.sum(evict >= 0)]).astype(jnp.int32)
    predicted = jnp.concatenate([sel, new_pred if new_pred.shape[0] else
                                 jnp.full((0,), -1, jnp.int32)])
    return fetch, evict, predicted, hit, new_res, new_score, new_last.astype(jnp.int32), delta


def _check_pages(name: str, state: SchedulerState, pages):
    """Shapes and dtype (static under jit): logical page ids [B, Hkv, K], integers."""
    if not jnp.issubdtype(pages.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer logical page ids, got dtype {pages.dtype}")
    if pages.ndim != 3 or pages.shape[:2] != state.resident.shape[:2]:
        raise ValueError(f"{name} must be [{state.resident.shape[0]}, "
                         f"{state.resident.shape[1]}, K], got {tuple(pages.shape)}")


@jax.jit
def plan(state: SchedulerState, selected_pages: jax.Array, prev_layer_selected=None,
         candidates=None) -> Plan:
    """selected_pages [B, Hkv, K] (logical pages, -1 = none; K <= W).

    prev_layer_selected [B, Hkv, K'] — the layer below's selection for the next
    step (known one layer ahead of need) — and candidates [B, Hkv, C] — this step's
    runner-up pages, best first — are the predictions; LRU ignores both.
    """
    _check_pages("selected_pages", state, selected_pages)
    for name, x in (("prev_layer_selected", prev_layer_selected), ("candidates", candidates)):
        if x is not None:
            _check_pages(name, state, x)
    W, K = state.resident.shape[-1], selected_pages.shape[-1]
    if K > W:
        raise ValueError(f"working set W={W} must hold the selection K={K}")
    b, h = selected_pages.shape[:2]
    if prev_layer_selected is not None and candidates is not None:
        # Pages both predictors name first (stable: each list keeps its own order).
        prev = prev_layer_selected.astype(jnp.int32)
        agree = jax.vmap(jax.vmap(_member))(prev, candidates.astype(jnp.int32))
        order = jnp.argsort(~agree, axis=-1, stable=True)
        prev_layer_selected = jnp.take_along_axis(prev, order, axis=-1)
    parts = [x.astype(jnp.int32) for x in (prev_layer_selected, candidates) if x is not None]
    pred = (jnp.concatenate(parts, axis=-1) if parts
            else jnp.zeros((b, h, 0), jnp.int32))
    n_fetchable = pred.shape[-1]
    if candidates is not None and not state.policy.prefetch_candidates:
        n_fetchable -= candidates.shape[-1]
    row = functools.partial(_plan_row, state.policy, state.step, n_fetchable=n_fetchable)
    f = jax.vmap(jax.vmap(row))
    fetch, evict, predicted, hit, res, score, last, delta = f(
        state.resident, state.score, state.last_used, selected_pages.astype(jnp.int32), pred)
    return Plan(fetch=fetch, evict=evict, predicted=predicted, hit=hit, resident=res,
                score=score, last_used=last, delta=jnp.sum(delta, axis=(0, 1)))


@jax.jit
def apply(state: SchedulerState, p: Plan) -> SchedulerState:
    """Commit a plan (after the host issued its copies)."""
    return state.replace(resident=p.resident, score=p.score, last_used=p.last_used,
                         step=state.step + 1, counters=state.counters + p.delta)


@jax.jit
def plan_prefetch(state: SchedulerState, pages: jax.Array) -> Plan:
    """Layer-ahead prefetch, before this step's selection: pages [B, Hkv, K'] are
    what the layer below selected at this step (its next-layer prediction). Up
    to `max_prefetch` of them that are not resident are fetched, never in place
    of the last step's selection; LRU prefetches nothing. Commit with
    `apply_prefetch` (the step does not advance)."""
    _check_pages("pages", state, pages)
    b, h = pages.shape[:2]
    row = functools.partial(_plan_row, state.policy, state.step, between_steps=True)
    fetch, evict, predicted, hit, res, score, last, delta = jax.vmap(jax.vmap(row))(
        state.resident, state.score, state.last_used, jnp.full((b, h, 1), -1, jnp.int32),
        pages.astype(jnp.int32))
    return Plan(fetch=fetch, evict=evict, predicted=predicted, hit=hit, resident=res,
                score=score, last_used=last, delta=jnp.sum(delta, axis=(0, 1)))


@jax.jit
def apply_prefetch(state: SchedulerState, p: Plan) -> SchedulerState:
    return state.replace(resident=p.resident, score=p.score, last_used=p.last_used,
                         counters=state.counters + p.delta)


@functools.partial(jax.jit, static_argnums=1)
def resize(state: SchedulerState, working_set: int) -> tuple[SchedulerState, jax.Array]:
    """The working set resized to `working_set` slots per (sequence, KV head) (memory
    pressure shrinks it with the selection budget; relief grows it back). Shrinking
    keeps the pages the policy values most: the last step's selection, then by
    recency-weighted frequency, then recency. Returns (state, source [B, Hkv, W']
    int32: the old slot whose page each new slot keeps, -1 = empty slot)."""
    check_int("working_set", working_set, minimum=1)
    W = state.resident.shape[-1]
    recent = state.last_used >= state.step - 1
    value = jnp.where(state.resident >= 0,
                      2.0 * recent + state.score * (1.0 - state.policy.decay)
                      + (state.last_used + 1) / (state.step + 1.0), -jnp.inf)
    keep = min(W, working_set)
    top, src = jax.lax.top_k(value, keep)
    src = jnp.where(top > -jnp.inf, src, -1).astype(jnp.int32)
    pad = working_set - keep
    if pad:
        src = jnp.concatenate([src, jnp.full(src.shape[:2] + (pad,), -1, jnp.int32)], -1)

    def take(x, fill):
        return jnp.where(src >= 0, jnp.take_along_axis(x, jnp.maximum(src, 0), -1), fill)

    evicted = jnp.sum(state.resident >= 0) - jnp.sum(src >= 0)
    counters = state.counters.at[COUNTERS.index("evictions")].add(evicted.astype(jnp.int32))
    return state.replace(resident=take(state.resident, -1), score=take(state.score, 0.0),
                         last_used=take(state.last_used, -1), counters=counters), src


def forget_sequence(state: SchedulerState, seq) -> SchedulerState:
    """Empty sequence `seq`'s working set (it was released: its logical page ids
    will name another sequence's pages)."""
    seq = check_int("seq", seq, minimum=0, maximum=state.resident.shape[0] - 1)
    return _forget(state, seq)


@jax.jit
def _forget(state: SchedulerState, seq) -> SchedulerState:
    return state.replace(resident=state.resident.at[seq].set(-1),
                         score=state.score.at[seq].set(0.0),
                         last_used=state.last_used.at[seq].set(-1))


def step(state, selected_pages, prev_layer_selected=None, candidates=None):
    p = plan(state, selected_pages, prev_layer_selected, candidates)
    return apply(state, p), p


@functools.partial(jax.jit, static_argnames=("use_prev", "use_cand"))
def run_trace(state: SchedulerState, selected, prev_layer=None, candidates=None, *,
              use_prev=True, use_cand=True):
    """Scan a trace: selected [T, B, Hkv, K]; prev_layer [T, B, Hkv, K'] (the layer
    below at the same step); candidates [T, B, Hkv, C]. At step t the policy sees
    prev_layer[t + 1] (the next step's selection one layer down) and candidates[t]."""
    T = selected.shape[0]
    xs = {"sel": selected}
    if use_prev and prev_layer is not None:
        xs["prev"] = jnp.concatenate([prev_layer[1:], jnp.full_like(prev_layer[:1], -1)])
    if use_cand and candidates is not None:
        xs["cand"] = candidates

    def body(s, x):
        s, p = step(s, x["sel"], x.get("prev"), x.get("cand"))
        return s, jnp.sum(p.hit, axis=(1, 2))

    state, hits = jax.lax.scan(body, state, xs, length=T)
    return state, hits
