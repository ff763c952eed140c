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
  hit rate for many bytes, see docs/scheduler.md).
- "lru": keep = selected pages, then the most recently selected; demand fetch only.

Counters (int32, summed over sequences and heads): selected, hits (selected and
already resident), misses, fetched (misses + prefetched), prefetched, evictions.
Host->device bytes = fetched x `page_bytes(cfg)`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hisparse_jax import layout
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


# ---------------------------------------------------------------- traces

@dataclasses.dataclass(frozen=True)
class Trace:
    name: str
    selected: np.ndarray      # [T, 1, Hkv, K] logical pages: each step's candidates (what
                              # offload keeps resident; the re-rank attends a budget of them)
    prev_layer: np.ndarray    # [T, 1, Hkv, K] a synthetic adjacent layer's selection
    candidates: np.ndarray    # [T, 1, Hkv, K + C] a wider top-k of the same scores
    cfg: HiSparseConfig
    info: dict


def _overlap(a, b):
    """Mean share of a's pages (per row) also in b. a, b [..., K]."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    tot = hit = 0
    for x, y in zip(a2, b2):
        xs = set(x[x >= 0].tolist())
        tot += len(xs)
        hit += len(xs & set(y[y >= 0].tolist()))
    return hit / max(1, tot)


def make_trace(kind: str = "drift", *, context: int = 32768, steps: int = 256,
               segment: int = 32, num_kv_heads: int = 4, step_noise: float | None = None,
               step_overlap: float = 0.70, layer_noise: float = 0.3,
               extra_candidates: int = 64, sticky_nats: float | None = None,
               recall_every: int = 8, seed: int = 0, log=None) -> Trace:
    """A decode trace of real selections (`attention.select_pages` over a cache filled
    from `workloads.make_workload`), with queries that move over the steps. A
    step's selection is its candidate pages: offload keeps them all resident, and
    the attention's re-rank keeps a budget of them (recall is measured on those).

    kind "drift": the workload's mixed heads (sink, local, retrieval, diffuse); the
    query glides linearly from one anchor query to the next over `segment` steps,
    so the attended pages drift. kind "retrieval": every head a retrieval head;
    every `segment` steps the query jumps to one of 4 anchor queries (each asking for
    its own needle), so earlier needles are revisited. Both add per-step noise
    (`step_noise` x the query's norm, isotropic), the token-to-token jitter of real
    queries. With step_noise None it is solved (bisection, on the first steps) so
    that consecutive steps share `step_overlap` of their pages: 0.70 is the low end
    of the 70-100% published for real models (anchors.md), the hardest trace those
    reports allow; a fixed jitter instead gives lower overlap the longer the
    context. The adjacent layer is the same query with independent `layer_noise`.
    The context does not grow during the trace (pages turning cold are not modelled).

    The overlap is solved for selections without memory (`sticky_nats` 0: the
    plain top-k the published overlaps describe); the trace then decodes step by
    step with the config's `sticky_nats` (None: the default preset's), each layer
    remembering its own last step. info reports both overlaps and both recalls
    (DESIGN §4, every `recall_every`-th step), so the price of stickiness is in
    the same row as its hit rate.
    """
    from hisparse_jax.attention import decode_attention, remember, select_pages
    from hisparse_jax.cache import HiSparseCache
    from hisparse_jax.config import preset
    from hisparse_jax.evaluation import selection_recall
    from hisparse_jax.workloads import make_workload
    if kind not in ("drift", "retrieval"):
        raise ValueError(f"trace kind must be 'drift' or 'retrieval', got {kind!r}")
    log = log or (lambda *_: None)
    rng = np.random.default_rng(seed + 1000)
    n_seg = -(-steps // segment)
    n_anchor = n_seg + 1 if kind == "drift" else 4
    log(f"workload {kind}: {context} tokens, {num_kv_heads} KV heads, {n_anchor} anchor queries")
    wl = make_workload(context=context, num_kv_heads=num_kv_heads, num_queries=n_anchor,
                       kinds=None if kind == "drift" else ["retrieval"] * num_kv_heads,
                       seed=seed)
    ctx = -(-context // 16) * 16
    cfg = preset("default").replace(num_kv_heads=num_kv_heads, max_context=ctx)
    if sticky_nats is not None:
        cfg = cfg.replace(sticky_nats=sticky_nats)
    plain = cfg.replace(sticky_nats=0.0)
    cache = HiSparseCache(cfg, implementation="xla")
    cache.prefill(0, wl.k, wl.v)
    anchors = wl.q  # [N, Hq, D]
    t = np.arange(steps)
    if kind == "drift":
        a, frac = t // segment, (t % segment) / segment
        q = (1 - frac)[:, None, None] * anchors[a] + frac[:, None, None] * anchors[a + 1]
    else:
        order = [0]
        for _ in range(n_seg - 1):
            order.append(int(rng.choice([i for i in range(n_anchor) if i != order[-1]])))
        q = anchors[np.array(order)[t // segment]]
    norm = np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(q.shape[-1])
    z_step = rng.standard_normal(q.shape).astype(np.float32)
    z_layer = rng.standard_normal(q.shape).astype(np.float32)
    # The runner-ups: `extra_candidates` more candidates of the same scores.
    wide = cfg.replace(budget_tokens=(cfg.candidate_pages + extra_candidates) * cfg.page_size,
                       rerank_multiple=1)
    st = cache.state

    def independent(c):  # every step selected afresh
        return jax.jit(jax.vmap(lambda qq: select_pages(c, st, qq[None],
                                                        implementation="xla")[0]))

    @jax.jit
    def decode(qs):  # step by step, remembering the last step: (selected, wider top-k)
        def body(held, qq):
            s = st.replace(last_selected=held)
            pages = select_pages(cfg, s, qq[None], implementation="xla")[0]
            runner_ups = select_pages(wide, s, qq[None], implementation="xla")[0]
            return remember(cfg, s, pages).last_selected, (pages, runner_ups)
        return jax.lax.scan(body, st.last_selected, qs)[1]

    select_plain = independent(plain)
    if step_noise is None:
        step_noise = _solve_step_noise(select_plain, q, norm, z_step, step_overlap, log)
    q_step = jnp.asarray(q + step_noise * norm * z_step, jnp.float32)
    q_layer = jnp.asarray(q_step + layer_noise * norm * z_layer, jnp.float32)
    selected, cand = (np.asarray(x) for x in decode(q_step))
    prev = np.asarray(decode(q_layer)[0])
    selected_plain = np.asarray(select_plain(q_step))
    probe = range(0, steps, recall_every)

    def attended(c, sel):  # the pages the re-rank keeps from each probe step's candidates
        return np.stack([np.asarray(decode_attention(
            c, st if t == 0 else remember(c, st, jnp.asarray(sel[t - 1])), q_step[t][None],
            implementation="xla", return_selection=True)[1][0]) for t in probe])
    recall, recall_plain = (float(selection_recall(c, np.asarray(q_step)[list(probe)], wl.k,
                                                   attended(c, s)).mean())
                            for c, s in ((cfg, selected), (plain, selected_plain)))
    info = {"kind": kind, "context": context, "steps": steps, "segment": segment,
            "num_kv_heads": num_kv_heads, "budget_pages": cfg.budget_pages,
            "candidate_pages": cfg.candidate_pages,
            "bound_share": cfg.bound_share, "sticky_nats": cfg.sticky_nats,
            "cold_pages": int(np.sum(np.asarray(st.page_table[0]) >= 0)),
            "step_noise": step_noise, "layer_noise": layer_noise, "seed": seed,
            "overlap_consecutive_steps": _overlap(selected[1:], selected[:-1]),
            "overlap_consecutive_steps_plain": _overlap(selected_plain[1:],
                                                        selected_plain[:-1]),
            "overlap_adjacent_layer": _overlap(selected, prev),
            "overlap_runner_up_next_step": _overlap(selected[1:], cand[:-1]),
            "recall_mean": recall, "recall_mean_plain": recall_plain}
    return Trace(kind, selected, prev, cand, cfg, info)


def _solve_step_noise(select, q, norm, z, target, log, probe_steps=96, iters=8):
    """The per-step jitter at which consecutive selections share `target` of their
    pages (bisection on the first `probe_steps` steps; overlap falls as jitter grows)."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"step_overlap must be in (0, 1), got {target!r}")
    n = min(probe_steps, q.shape[0])
    lo, hi = 0.0, 2.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        s = np.asarray(select(jnp.asarray(q[:n] + mid * norm[:n] * z[:n], jnp.float32)))
        if _overlap(s[1:], s[:-1]) > target:
            lo = mid
        else:
            hi = mid
    noise = 0.5 * (lo + hi)
    log(f"step jitter {noise:.3f} x |q| gives consecutive-step overlap ~{target:.2f}")
    return noise


def synthetic_trace(*, steps: int = 64, num_pages: int = 512, k: int = 16, heads: int = 2,
                    drift: int = 2, seed: int = 0):
    """A fast, data-free drifting selection (tests): per head, K pages at a window
    that slides `drift` pages per step over a sticky core plus random pages.
    Returns (selected [T, 1, H, K], candidates [T, 1, H, K]) int32."""
    rng = np.random.default_rng(seed)
    sel = np.full((steps, 1, heads, k), -1, np.int32)
    cand = np.full((steps, 1, heads, k), -1, np.int32)
    core = rng.choice(num_pages, size=(heads, k // 4), replace=False)
    for h in range(heads):
        start = int(rng.integers(num_pages))
        for t in range(steps):
            win = (start + drift * t + np.arange(k // 2)) % num_pages
            rnd = rng.choice(num_pages, size=k, replace=False)
            pages = list(dict.fromkeys([*core[h], *win, *rnd]))[:k]
            sel[t, 0, h] = pages
            nxt = (start + drift * (t + 1) + np.arange(k // 2)) % num_pages
            c = [p for p in nxt if p not in pages]
            cand[t, 0, h, :len(c)] = c
    return sel, cand


# ---------------------------------------------------------------- bench

def evaluate(trace: Trace, working_set: int, policy: Policy, *, use_prev=True,
             use_cand=True) -> dict:
    sel = jnp.asarray(trace.selected)
    s0 = init_state(sel.shape[1], sel.shape[2], working_set, policy)
    s, _ = run_trace(s0, sel, jnp.asarray(trace.prev_layer), jnp.asarray(trace.candidates),
                     use_prev=use_prev, use_cand=use_cand)
    c = counters(s, trace.cfg)
    steps = sel.shape[0]
    c["h2d_bytes_per_step"] = c["host_to_device_bytes"] / steps
    c["h2d_bytes_per_step_per_head"] = c["h2d_bytes_per_step"] / (sel.shape[1] * sel.shape[2])
    return c


def belady_hit_rate(selected: np.ndarray, working_set: int) -> float:
    """Oracle bound for eviction alone (demand fetch, no prefetch): Belady's MIN, which
    evicts the resident page whose next selection is farthest in the future.
    selected [T, B, H, K] -> hit rate. Host-side numpy (a reference, not a policy)."""
    T = selected.shape[0]
    rows = selected.reshape(T, -1, selected.shape[-1])
    hits = total = 0
    for r in range(rows.shape[1]):
        steps = [set(x[x >= 0].tolist()) for x in rows[:, r]]
        uses: dict[int, list[int]] = {}
        for t, st in enumerate(steps):
            for p in st:
                uses.setdefault(p, []).append(t)
        ptr = {p: 0 for p in uses}
        res: set[int] = set()
        for t, st in enumerate(steps):
            hits += len(st & res)
            total += len(st)
            for p in st:
                ptr[p] += 1
            res |= st
            if len(res) > working_set:
                nxt = {p: uses[p][ptr[p]] if ptr[p] < len(uses[p]) else T + 1
                       for p in res - st}
                extra = sorted(nxt, key=nxt.__getitem__, reverse=True)
                res -= set(extra[:len(res) - working_set])
    return hits / max(1, total)


def bench_scheduler(*, context: int = 32768, steps: int = 256, multiples=(1, 2, 4),
                    kinds=("drift", "retrieval"), seed: int = 0,
                    step_noise: float | None = None, step_overlap: float = 0.70,
                    layer_noise: float = 0.3, max_prefetch=(32,), oracle: bool = False,
                    sticky_nats: float | None = None, log=None) -> list[dict]:
    """Resident hit rate and host->device bytes per step, predictive policy vs LRU,
    at working sets of `multiples` x a step's candidate pages (what must be
    resident), on real-selection traces."""
    log = log or (lambda *_: None)
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        tr = make_trace(kind, context=context, steps=steps, seed=seed, step_noise=step_noise,
                        step_overlap=step_overlap, layer_noise=layer_noise,
                        sticky_nats=sticky_nats, log=log)
        log(f"trace {kind} built in {time.perf_counter() - t0:.1f}s: "
            + ", ".join(f"{k}={v:.4f}" for k, v in tr.info.items()
                        if k.startswith(("overlap", "recall"))))
        K = tr.selected.shape[-1]
        variants = [("lru", LRU, True, True),
                    # default: prefetch the layer below's pages, keep runner-ups resident
                    *((("predictive" if n == Policy().max_prefetch else f"predictive-pf{n}"),
                       Policy(max_prefetch=n), True, True) for n in max_prefetch),
                    # a first layer (no layer below): prefetch the runner-ups instead
                    ("predictive-runner-ups", Policy(prefetch_candidates=True), False, True),
                    # eviction by recency-weighted frequency alone, no prediction
                    ("frequency-only", Policy(max_prefetch=0), False, False)]
        for m in multiples:
            if oracle:
                rows.append({"case": f"scheduler_{kind}_{m}x", "trace": kind,
                             "policy": "belady-oracle-no-prefetch", "working_set_multiple": m,
                             "working_set_pages": int(m * K), **tr.info,
                             "hit_rate": belady_hit_rate(tr.selected, int(m * K))})
            for name, pol, up, uc in variants:
                c = evaluate(tr, int(m * K), pol, use_prev=up, use_cand=uc)
                rows.append({"case": f"scheduler_{kind}_{m}x", "trace": kind, "policy": name,
                             "working_set_multiple": m, "working_set_pages": int(m * K),
                             **tr.info, **c})
    return rows
