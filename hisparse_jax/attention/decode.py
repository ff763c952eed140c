"""Sparse decode attention: re-rank the candidates by their int4 keys, attend
sink, window and the chosen cold pages, and one decode step or layer in place."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from hisparse_jax import backends
from hisparse_jax.attention.selection import (
    _RERANK_KEY,
    TAIL_UNIFORM_SHARE,
    _offsets,
    _systematic,
    group_queries,
    head_sum,
    pool_pages,
    remember,
    row_sum,
    select,
    stacked_source,
)
from hisparse_jax.cache.state import (
    WINDOW_FIELDS,
    CacheState,
    append_layer,
    slot_positions,
)
from hisparse_jax.config import HiSparseConfig
from pallas_kernels.quant.reference import INT4_LEVELS
from pallas_kernels.sparse_decode import reference as decode_ref


def rerank(cfg: HiSparseConfig, logits: jax.Array, seq_lens: jax.Array,
           bound: jax.Array | None = None, window_lse: jax.Array | None = None):
    """Which candidates a decode step attends, from their exact (int4) logits.

    Each query head's share of every candidate page's mass among the candidates
    (`cfg.rerank_weight` "share"), or among the window and the candidates
    ("mass", which needs window_lse), summed over the group, ranks them; the
    `budget_pages` best are kept. Given
    each candidate's Quest bound (`candidate_bounds`) and the window's log-sum-exp,
    a sharp query head (one candidate holds more than `cfg.quest_floor_mass` of
    its mass on the window and the candidates) keeps at least the int4 mass that
    plain Quest's pages among the candidates give it (`_quest_floor`).
    Of the rejected ones, `cfg.rerank_samples` are drawn in one systematic sample,
    a quarter of it uniform and the rest in proportion to their group mass, and
    weighted by 1 / their expected number of draws: their mass is estimated, as
    `sample_tail` does for the pages that were not candidates.

    logits [B, Hkv, G, C, T] scaled, -inf where masked; seq_lens [B]; bound: the
    candidates' Quest bound [B, Hkv, G, C] (`candidate_bounds`; or a function
    returning it, called only when some head is sharp) and window_lse [B, Hkv, G]
    (`window_lse`), or None (no floor) ->
    (kept [B, Hkv, K], drawn [B, Hkv, m]: indices into the C candidates, -1 = none;
    drawn_logw [B, Hkv, m] f32 log weights, 0 where none)."""
    b, h, _, c, _ = logits.shape
    # In linear space, one exp: shares a head's maximum leaves below float32's
    # range count as zero (they carry < 1e-38 of its candidates' mass).
    top = jnp.max(logits, axis=(-2, -1), keepdims=True)
    page = row_sum(jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)))
    share = page / jnp.maximum(row_sum(page)[..., None], 1e-30)
    window = None
    if window_lse is not None:
        # Each head's mass on the window, in units of its candidates' mass.
        cand_lse = top[..., 0, 0] + jnp.log(row_sum(page))  # [B, Hkv, G]
        window = jnp.exp(jnp.minimum(window_lse - cand_lse, 80.0))
        window = jnp.where(jnp.isnan(window), 0.0, window)
    if cfg.rerank_weight == "mass":  # each head's mass on window + candidates
        if window is None:
            raise ValueError("rerank_weight='mass' needs the window's log-sum-exp")
        group = head_sum(share / (1.0 + window[..., None]))
    else:
        group = head_sum(share)                                   # [B, Hkv, C]
    valid = group > 0                                             # NaN keys: never attended
    score = jnp.where(valid, group, -1.0)
    k = min(cfg.budget_pages, c)
    if bound is not None and cfg.quest_floor_mass < 1 and k < c:
        share = jnp.where(valid[:, :, None], share, 0.0)
        sharp = jnp.max(share, axis=-1) > cfg.quest_floor_mass * (1.0 + window)
        # Only when some head is sharp (random keys: never): the bounds' gather and
        # the floor are a large share of the step (docs/log/code-timings.md, "floor").
        score = jax.lax.cond(
            jnp.any(sharp),
            lambda: _quest_floor(score, share, sharp, QUEST_FLOOR_SLACK * (1.0 + window),
                                 bound() if callable(bound) else bound, k),
            lambda: score)
    best, kept = jax.lax.top_k(score, k)
    kept = jnp.where(best > 0, kept, -1).astype(jnp.int32)
    m = cfg.rerank_samples
    if m == 0:
        return kept, jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), jnp.float32)
    free = valid.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
                    jnp.where(kept >= 0, kept, c)].set(False, mode="drop")
    share = jnp.where(free, group, 0.0)
    share = share / jnp.maximum(row_sum(share)[..., None], 1e-30)
    uniform = free / jnp.maximum(jnp.sum(free, axis=-1, keepdims=True), 1)
    prob = TAIL_UNIFORM_SHARE * uniform + (1 - TAIL_UNIFORM_SHARE) * share
    u = _offsets(cfg, seq_lens, _RERANK_KEY, (h,))                # [B, Hkv]
    drawn = _systematic(jnp.cumsum(prob, axis=-1).reshape(b * h, c), u.reshape(-1), m)
    drawn = drawn.reshape(b, h, m)
    p_drawn = jnp.take_along_axis(prob, drawn, axis=-1)
    ok = jnp.take_along_axis(free, drawn, axis=-1) & (p_drawn > 0)
    logw = jnp.where(ok, -jnp.log(jnp.where(ok, m * p_drawn, 1.0)), 0.0)
    return kept, jnp.where(ok, drawn, -1).astype(jnp.int32), logw.astype(jnp.float32)


# How far below Quest's pages' mass the floor lets a sharp head fall, as a share
# of its mass on the window and the candidates. With 0, several sharp heads a few
# ten-thousandths short pull a group to Quest's set (GQA-4 generated sharp
# workload: mean recall 0.590 -> 0.581); with 1e-4 the 128K test workload's
# concentrated recall fell to 0.9494 (< 0.95) and one needle page was lost.
QUEST_FLOOR_SLACK = 1e-3


def _quest_floor(score, share, sharp, slack, bound, k):
    """The re-rank's score [B, Hkv, C] (group mass shares, -1 = not valid) with
    every page outside the chosen budget set at -1. Of the sets made of the
    score's best j pages followed by plain Quest's order (the best group-maximum
    bounds) up to k pages, j = 0..k, the one with the most group score among those
    that give every sharp query head (sharp [B, Hkv, G]) at least the int4 mass
    (share [B, Hkv, G, C]) of Quest's own k pages (j = 0, always allowed), less
    slack [B, Hkv, G] (in the same units). Where
    the score's best k already do (most groups; all without a sharp head), that
    is the set, as without the floor.

    Why (issue 14): the shares count every head alike, so a head whose mass sits
    almost all in the window outvotes a sharp head for its spread remainder, and
    the sharp head ends below plain Quest (by up to 0.07 of its mass on SmolLM2's
    heads). Only sharp heads are held to Quest: held for every head, the floor
    cost the 128K test workload's concentrated heads 0.002 of recall."""
    c = score.shape[-1]
    valid = score > 0
    qb = jnp.max(bound, axis=2)
    qb = jnp.where(valid & ~jnp.isnan(qb), qb, -jnp.inf)
    order_s = jax.lax.top_k(score, c)[1]                          # [B, Hkv, C]
    order_q = jax.lax.top_k(qb, c)[1]
    rank_s, rank_q = jnp.argsort(order_s, axis=-1), jnp.argsort(order_q, axis=-1)
    j = jnp.arange(k + 1)
    lead = (rank_s[:, :, None, :] < j[:, None]) & valid[:, :, None]   # [B, Hkv, J, C]
    rest = jnp.take_along_axis(~lead & valid[:, :, None], order_q[:, :, None, :], axis=-1)
    fill = rest & (jnp.cumsum(rest, axis=-1) <= (k - j)[:, None])      # in Quest's order
    member = lead | jnp.take_along_axis(fill, rank_q[:, :, None, :], axis=-1)
    mass = jnp.einsum("bhjc,bhgc->bhjg", member.astype(share.dtype), share)
    ok = jnp.all((mass >= mass[:, :, :1] - slack[:, :, None]) | ~sharp[:, :, None],
                 axis=-1)  # j = 0: Quest's set
    total = row_sum(mass)
    # The best allowed j; on ties the larger (more of the shares' order).
    pick = k - jnp.argmax(jnp.where(ok, total, -1.0)[..., ::-1], axis=-1)
    chosen = jnp.take_along_axis(member, pick[:, :, None, None], axis=2)[:, :, 0]
    return jnp.where(chosen, score, -1.0)


def candidate_bounds(q: jax.Array, int4_k: jax.Array, digest_center: jax.Array,
                     digest_radius: jax.Array, slots: jax.Array):
    """Quest's bound sum_d max(q_d lo_d, q_d hi_d) / sqrt(D) [B, Hkv, G, C] (-inf
    where slots is -1) of the candidates at pool slots [B, Hkv, C] for grouped
    queries q [B, Hkv, G, D], over each page's per-channel range of its int4 keys
    (the codes' min and max). That range is within half a quantization step of the
    keys' own, so this orders pages closer to plain Quest over the exact keys than
    the digest's range, which is wider (its e4m3 radius is rounded up, by up to
    1/8): with it the floor protected the wrong edge pages (docs/log/results.md).
    At the budget's edge the order can still differ from exact Quest's."""
    return _bounds(q, *candidate_pages(int4_k, digest_center, digest_radius, slots), slots)


def candidate_pages(int4_k, digest_center, digest_radius, slots):
    """What `candidate_bounds` reads of the pool: the candidates' int4 keys [B, Hkv,
    C, T, D/2] and their digests [B, Hkv, C, D] (zeros where slots is -1). Gather
    them outside a `lax.cond`: a pool passed into one is copied whole first."""
    heads = jnp.arange(slots.shape[1])[None, :, None]
    ok = slots >= 0
    ids = jnp.maximum(slots, 0)
    c = jnp.where(ok[..., None], digest_center[heads, ids].astype(jnp.float32), 0.0)
    r = jnp.where(ok[..., None], digest_radius[heads, ids].astype(jnp.float32), 0.0)
    return int4_k[heads, ids], c, r


def _bounds(q, kc, c, r, slots):
    ok = slots >= 0
    lo, step = c - r, r * (2.0 / INT4_LEVELS)                # as decode_ref.cold_logits
    cmin = jnp.concatenate([jnp.min(kc & 0xF, axis=3), jnp.min(kc >> 4, axis=3)], -1)
    cmax = jnp.concatenate([jnp.max(kc & 0xF, axis=3), jnp.max(kc >> 4, axis=3)], -1)
    kmin = lo + step * cmin.astype(jnp.float32)
    kmax = lo + step * cmax.astype(jnp.float32)
    qs = q.astype(jnp.float32) * (1.0 / math.sqrt(q.shape[-1]))
    bound = (jnp.einsum("bhgd,bhcd->bhgc", jnp.maximum(qs, 0), kmax)
             + jnp.einsum("bhgd,bhcd->bhgc", jnp.minimum(qs, 0), kmin))
    return jnp.where(ok[:, :, None], bound, -jnp.inf)


def window_lse(q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale,
               fp8_valid, sm_scale):
    """log sum exp [B, Hkv, G] of the scaled logits over the sink, hot and warm
    tokens (`decode_ref.window_parts`' arguments): the window parts' own, so that
    the XLA path computes them once (the same ops, merged by XLA) and the Pallas
    path drops their values as dead code."""
    return decode_ref.merge_parts(decode_ref.window_parts(
        q, bf16_k, bf16_v, bf16_valid, fp8_k, fp8_v, fp8_k_scale, fp8_v_scale, fp8_valid,
        sm_scale))[1]


def take_or_none(x, idx):
    """x [B, Hkv, C] at idx [B, Hkv, K] (-1 -> -1)."""
    return jnp.where(idx >= 0, jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=-1), -1)


COLD_FIELDS = ("int4_k", "int4_v", "int4_v_scale", "int4_v_zero", "digest_center",
               "digest_radius")


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def attend_pages(cfg: HiSparseConfig, state: CacheState, q: jax.Array, logical: jax.Array,
                 sample: jax.Array | None = None, sample_logw: jax.Array | None = None, *,
                 implementation=None) -> jax.Array:
    """Decode attention over sink + hot + warm + the given cold pages (+ an
    importance sample of the others, weighted by exp(sample_logw)).

    q [B, Hq, D]; logical [B, Hkv, C] logical page ids (-1 = none; pages that are
    not cold are ignored; more than `cfg.budget_pages` are candidates, re-ranked
    by `rerank`); sample, sample_logw [B, Hkv, n] (`sample_tail`)
    -> out [B, Hq, D] float32.
    """
    return _attend_logical(cfg, state, q, logical, sample, sample_logw, implementation)[0]


def _attend_logical(cfg, state, q, logical, sample, sample_logw, implementation,
                    stacked=None):
    """(out, attended logical pages [B, Hkv, min(C, K)]). stacked:
    `selection.stacked_source`'s (the layer-stacked state `state` is a view of,
    the layer), for implementations that read its tiers and pool in place."""
    if sample is None:
        sample = jnp.zeros(logical.shape[:2] + (0,), jnp.int32)
        sample_logw = jnp.zeros(sample.shape, jnp.float32)
    cold = tuple(getattr(state, f) for f in COLD_FIELDS)
    out, kept = _attend_cold_checked(cfg, state, q, cold, pool_pages(state.page_table, logical),
                                     pool_pages(state.page_table, sample), sample_logw,
                                     stacked, implementation)
    return out, take_or_none(logical, kept)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def attend_cold_slots(cfg: HiSparseConfig, state: CacheState, q: jax.Array, cold: tuple,
                      slots: jax.Array, sample_slots: jax.Array, sample_logw: jax.Array, *,
                      implementation=None):
    """Decode attention whose cold pages are read from `cold` (arrays laid out like
    the state's pool, COLD_FIELDS order): the candidates at `slots` [B, Hkv, C]
    (-1 = none), re-ranked down to `cfg.budget_pages` (`rerank`) when there are
    more, and the sampled pages at `sample_slots` [B, Hkv, n], each weighted by
    exp(sample_logw) [B, Hkv, n]. `cold` is the state's own pool, or an offload
    working set.

    -> (out [B, Hq, D] float32, NaN for poisoned sequences; kept [B, Hkv, min(C, K)]:
    the attended candidates, as indices into `slots`, -1 = none)."""
    return _attend_cold_checked(cfg, state, q, cold, slots, sample_slots, sample_logw, None,
                                implementation)


def _attend_cold_checked(cfg, state, q, cold, slots, sample_slots, sample_logw, stacked,
                         implementation):
    """`attend_cold_slots`; stacked: `selection.stacked_source`'s, where `state`
    and its pool `cold` are a layer of a stacked state."""
    out, kept = _attend_cold_slots(cfg, state, q, cold, slots, sample_slots, sample_logw,
                                   stacked, implementation)
    return jnp.where(state.poisoned[:, None, None], jnp.nan, out), kept


def _attend_cold_slots(cfg, state, q, cold, slots, sample_slots, sample_logw, stacked,
                       implementation):
    backend = backends.resolve("attend_cold", implementation, cfg=cfg)
    # Without a tail sample the weights are constant zeros inside decode_attention's
    # jit, and XLA folds `logits + 0` into a different op order than the offload
    # path, which passes them at run time; the barrier keeps both bit-equal.
    sample_logw = jax.lax.optimization_barrier(sample_logw)
    bf16_pos, fp8_pos = slot_positions(cfg, state.seq_lens)
    qg = group_queries(cfg, q).astype(jnp.float32)
    valid = (bf16_pos >= 0, fp8_pos >= 0)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    return backends.kernel("attend_cold", backend)(cfg, state, qg, valid, cold, slots,
                                                   sample_slots, sample_logw, stacked, sm_scale)


def _window(tiers, qg, valid):
    """The window's arguments of `decode_ref.window_parts` from `tiers` (a state)."""
    return (qg, tiers.bf16_k, tiers.bf16_v, valid[0], tiers.fp8_k, tiers.fp8_v,
            tiers.fp8_k_scale, tiers.fp8_v_scale, valid[1])


@backends.register("attend_cold", "xla")
def _attend_cold_reference(cfg, state, qg, valid, cold, slots, sample_slots, sample_logw,
                           stacked, sm_scale):
    return _attend_cold_jnp(cfg, state, qg, valid, cold, slots, sample_slots, sample_logw,
                            sm_scale, decode_ref.sparse_decode, reuse_logits=True)


@backends.register("attend_cold", "pallas", why_not=backends.pallas_why_not)
def _attend_cold_pallas(cfg, state, qg, valid, cold, slots, sample_slots, sample_logw,
                        stacked, sm_scale):
    """The re-rank in XLA, the attention in the Pallas kernel (which reads the
    attended pages' keys again)."""
    from pallas_kernels.sparse_decode import kernel
    return _attend_cold_jnp(cfg, state, qg, valid, cold, slots, sample_slots, sample_logw,
                            sm_scale, kernel.sparse_decode, reuse_logits=False)


def _attend_cold_jnp(cfg, state, qg, valid, cold, slots, sample_slots, sample_logw, sm_scale,
                     sparse_decode, reuse_logits: bool):
    """`attend_cold_slots` with the re-rank in XLA and `sparse_decode` attending.
    reuse_logits: the attended pages' logits are taken from the re-rank's (XLA),
    else `sparse_decode` reads their keys again (a kernel)."""
    window = _window(state, qg, valid)
    b = qg.shape[0]
    out_shape = (b, cfg.num_q_heads, cfg.head_dim)
    c = slots.shape[-1]
    if c <= cfg.budget_pages:  # every candidate is attended
        kept = jnp.where(slots >= 0, jnp.arange(c, dtype=jnp.int32), -1)
        ids = jnp.concatenate([slots, sample_slots], axis=-1)
        logw = jnp.concatenate([jnp.zeros(slots.shape, jnp.float32), sample_logw], axis=-1)
        out = sparse_decode(*window, *cold, ids, sm_scale=sm_scale, cold_logw=logw)[0]
        return out.reshape(out_shape), kept
    int4_k, int4_v, int4_v_scale, int4_v_zero, center, radius = cold
    # Candidates and sample in one list: for XLA one gather and dot for both.
    listed = jnp.concatenate([slots, sample_slots], axis=-1)
    raw = decode_ref.cold_logits(qg, int4_k, center, radius, listed if reuse_logits else slots)
    cand_logits = decode_ref.weighted_logits(raw[:, :, :, :c], slots, None, sm_scale)
    floor = {}
    if cfg.quest_floor_mass < 1 or cfg.rerank_weight == "mass":
        floor["window_lse"] = window_lse(*window, sm_scale)
    if cfg.quest_floor_mass < 1:
        pages = candidate_pages(int4_k, center, radius, slots)
        floor["bound"] = lambda: _bounds(qg, *pages, slots)
    kept, drawn, drawn_logw = rerank(cfg, cand_logits, state.seq_lens, **floor)
    n = sample_slots.shape[-1]
    picked = jnp.concatenate([kept, drawn, jnp.broadcast_to(c + jnp.arange(n, dtype=jnp.int32),
                                                             sample_slots.shape)], axis=-1)
    ids = take_or_none(listed, picked)
    logw = jnp.concatenate([jnp.zeros(kept.shape, jnp.float32), drawn_logw, sample_logw],
                           axis=-1)
    if not reuse_logits:
        out = sparse_decode(*window, *cold, ids, sm_scale=sm_scale, cold_logw=logw)[0]
        return out.reshape(out_shape), kept
    logits = decode_ref.weighted_logits(
        jnp.take_along_axis(raw, jnp.maximum(picked, 0)[:, :, None, :, None], axis=3),
        ids, logw, sm_scale)
    parts = decode_ref.window_parts(*window, sm_scale)
    parts.append(decode_ref.attend_cold_logits(logits, int4_v, int4_v_scale, int4_v_zero, ids))
    return decode_ref.merge_parts(parts)[0].reshape(out_shape), kept


@backends.register("attend_cold", "cpu", why_not=backends.cpu_decode_why_not,
                   reads_in_place=WINDOW_FIELDS, label="C++")
def _attend_cold_cpu(cfg, state, qg, valid, cold, slots, sample_slots, sample_logw,
                     stacked, sm_scale):
    """`attend_cold_slots` on the C++ kernels (cpu_kernels/): the window's softmax,
    the listed pages' logits, the re-rank, and one kernel for the rest of the
    arithmetic (`attend_listed`). With `stacked`, the kernels read the layer's
    tiers and pool in the stacked arrays (an FFI operand cannot be a slice, and
    XLA would copy the layer's pool for one)."""
    from cpu_kernels import ops
    tiers, layer = stacked or (state, None)
    if stacked is not None:
        cold = tuple(getattr(tiers, f) for f in COLD_FIELDS)
    window = _window(tiers, qg, valid)
    int4_k, int4_v, int4_v_scale, int4_v_zero, center, radius = cold
    [window_part] = ops.window_parts(*window, sm_scale, layer=layer)
    c, n = slots.shape[-1], sample_slots.shape[-1]
    listed = jnp.concatenate([slots, sample_slots], axis=-1)
    raw = ops.cold_logits(qg, int4_k, center, radius, listed, layer=layer)
    if c <= cfg.budget_pages:  # every candidate is attended
        kept = jnp.where(slots >= 0, jnp.arange(c, dtype=jnp.int32), -1)
        picked = jnp.broadcast_to(jnp.arange(c + n, dtype=jnp.int32), listed.shape)
        logw = jnp.concatenate([jnp.zeros(slots.shape, jnp.float32), sample_logw], axis=-1)
    else:
        # the re-rank in C++ too, with the floor's bounds read from the pool in place
        kept, drawn, drawn_logw = ops.rerank(
            raw, slots, window_part[1], qg, int4_k, center, radius,
            _offsets(cfg, state.seq_lens, _RERANK_KEY, (slots.shape[1],)),
            k=min(cfg.budget_pages, c), m=cfg.rerank_samples, sm_scale=sm_scale,
            floor=cfg.quest_floor_mass, slack=QUEST_FLOOR_SLACK,
            uniform_share=TAIL_UNIFORM_SHARE, mass_weight=cfg.rerank_weight == "mass",
            layer=layer)
        picked = jnp.concatenate([kept, drawn, jnp.broadcast_to(
            c + jnp.arange(n, dtype=jnp.int32), sample_slots.shape)], axis=-1)
        logw = jnp.concatenate([jnp.zeros(kept.shape, jnp.float32), drawn_logw, sample_logw],
                               axis=-1)
    out = ops.attend_listed(raw, picked, take_or_none(listed, picked), logw, *window_part,
                            int4_v, int4_v_scale, int4_v_zero, sm_scale=sm_scale, layer=layer)[0]
    return out.reshape(qg.shape[0], -1, qg.shape[-1]), kept


@functools.partial(jax.jit, static_argnames=("cfg", "implementation", "return_selection"))
def decode_attention(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *,
                     implementation=None, return_selection=False):
    """HiSparse decode attention for one query per sequence, after its last append.

    q: [B, Hq, D] -> out [B, Hq, D] float32 (zeros for empty sequences).
    With return_selection, also the attended logical pages [B, Hkv, K] (the
    candidates the re-rank kept; the sampled ones are not part of it). The
    selection favours the candidates of `state.last_selected`; `decode_step`
    also returns the state that remembers this step's (what the cache does).
    """
    out, pages, _ = decode_step(cfg, state, q, implementation=implementation)
    return (out, pages) if return_selection else out


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def decode_step(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *, implementation=None,
                layer=None):
    """`decode_attention` as a decode step: (out [B, Hq, D], attended logical pages
    [B, Hkv, K], the state after `remember`ing this step's candidates). With
    `layer`, `state` is layer-stacked and the step reads that layer (the state
    returned is the layer's: `selection.stacked_source`)."""
    view, source = stacked_source(cfg, state, layer)
    sel = select(cfg, state, q, implementation=implementation, layer=layer)
    out, pages = _attend_logical(cfg, view, q, sel.pages, sel.sample, sel.sample_logw,
                                 implementation, source)
    return out, pages, remember(cfg, view, sel.pages)


def decode_layer(cfg: HiSparseConfig, stacked: CacheState, layer, q, k, v, active, *,
                 implementation=None):
    """One layer of a model's decode step on a layer-stacked state
    (`state.init_stacked`), in place: append each active sequence's k, v [B, Hkv,
    D] (`state.append_layer`), attend with q [B, Hq, D] (`decode_step`) and
    remember its candidates (all a decode step changes besides the append).
    -> (out [B, Hq, D] float32, stacked)."""
    stacked = append_layer(cfg, stacked, layer, k, v, active, implementation=implementation)[0]
    out, _, after = decode_step(cfg, stacked, q, implementation=implementation, layer=layer)
    return out, stacked.replace(
        last_selected=stacked.last_selected.at[layer].set(after.last_selected))
