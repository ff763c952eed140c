"""Attention entry points: page selection, sparse decode, dense references, prefill.

`implementation=None | "xla" | "pallas" | "cpu"` picks the kernels (None: Pallas
on a GPU, the C++ kernels of cpu_kernels/ on the CPU, where each takes the cache's
shapes, XLA otherwise: `resolve_implementation`). All compute the same function;
the XLA path is the reference.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hisparse_jax.config import FULL_BUDGET, HiSparseConfig, resolve_implementation
from hisparse_jax.state import CacheState, append_layer, layer_view, slot_positions
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.quant.reference import INT4_LEVELS
from pallas_kernels.sparse_decode import reference as decode_ref


def _ops(implementation, cfg: HiSparseConfig):
    """(page_scores, sparse_decode) for an implementation name."""
    impl = resolve_implementation(implementation, cfg)
    if impl == "pallas":
        from pallas_kernels.lookup import kernel as lookup_kernel
        from pallas_kernels.sparse_decode import kernel as decode_kernel
        return lookup_kernel.page_scores, decode_kernel.sparse_decode
    if impl == "cpu":
        from cpu_kernels import ops
        return ops.page_scores, ops.sparse_decode
    return lookup_ref.page_scores, decode_ref.sparse_decode


def group_queries(cfg: HiSparseConfig, q: jax.Array) -> jax.Array:
    """[B, Hq, D] -> [B, Hkv, G, D]; query head i reads KV head i // G."""
    return q.reshape(q.shape[0], cfg.num_kv_heads, cfg.gqa_group, cfg.head_dim)


class Selection(NamedTuple):
    """What one decode step reads per (sequence, KV head), beside sink/hot/warm."""
    pages: jax.Array        # [B, Hkv, C] int32 candidate logical pages, -1 = none; the
                            # attention keeps budget_pages of them (`rerank`)
    sample: jax.Array       # [B, Hkv, n] int32 sampled non-candidate pages, -1 = none
    sample_logw: jax.Array  # [B, Hkv, n] f32 log importance weight of each sample entry


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def select(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *,
           implementation=None, stacked=None) -> Selection:
    """The candidate cold pages (`select_pages`) and an importance sample of the
    others (`sample_tail`). stacked: see `_attend_logical`."""
    pages, mass = _select(cfg, state, q, implementation, stacked)
    sample, logw = sample_tail(cfg, mass, pages, state.seq_lens, implementation=implementation)
    return Selection(pages, sample, logw)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def select_pages(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *, implementation=None):
    """The candidate cold pages per (sequence, KV head), `cfg.candidate_pages` of
    them: when a head's bound has far pages (`cfg.peak_pages`), plain Quest's top
    pages (the group's maximum bound) first; each query head's top pages by
    Quest's upper bound (a `bound_share` of them split between the group's
    heads), then the two pages beside each head's top bound page (a span's tail),
    then the pages with the most estimated group mass. The pages of
    `state.last_selected` (the last step's, see `remember`) score
    `cfg.sticky_nats` higher in both rankings. The decode attention scores
    their int4 keys and attends the `budget_pages` with the most mass (`rerank`);
    without a re-rank (rerank_multiple=1) the candidates are the attended pages.

    q [B, Hq, D] -> (logical pages [B, Hkv, C] int32 in page order, pool pages [B,
    Hkv, C] int32, -1 (last) where fewer than C cold pages exist). Sink, hot and
    warm pages have no page table entry, so they are never candidates.
    """
    logical, _ = _select(cfg, state, q, implementation)
    return logical, pool_pages(state.page_table, logical)


@jax.jit
def pool_pages(page_table: jax.Array, logical: jax.Array) -> jax.Array:
    """Pool page of each logical page: page_table [B, N], logical [B, Hkv, K] (-1 kept)."""
    pool = jnp.take_along_axis(page_table[:, None, :], jnp.maximum(logical, 0), axis=2)
    return jnp.where(logical >= 0, pool, -1).astype(jnp.int32)


def _first_argmax(x):
    """jnp.argmax over the last axis (NaN counts as the maximum, all -inf -> 0) as two
    plain reductions: XLA:CPU's variadic argmax reduce took 0.4 ms per step at 128K."""
    nan = jnp.isnan(x)
    top = jnp.where(jnp.any(nan, axis=-1, keepdims=True), jnp.nan, jnp.max(x, axis=-1,
                                                                          keepdims=True))
    hit = jnp.where(jnp.isnan(top), nan, x == top)
    n = x.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1) % n


def _page_scores(cfg, state, q, implementation, stacked):
    """(bound, mass) of `lookup_ref.page_scores`. The "cpu" kernel reads the digests
    of a layer-stacked state in place (stacked: see `_attend_logical`)."""
    page_scores, _ = _ops(implementation, cfg)
    qg = group_queries(cfg, q)
    if resolve_implementation(implementation, cfg) == "cpu":
        digests, layer = stacked or (state, None)
        return page_scores(qg, digests.digest_center, digests.digest_radius,
                           state.page_table, layer=layer)
    return page_scores(qg, state.digest_center, state.digest_radius, state.page_table)


def _select(cfg, state, q, implementation, stacked=None):
    """(candidate logical pages [B, Hkv, C], estimated group mass of every page
    [B, Hkv, N] (log, -inf = not a candidate; without the stickiness bonus, which
    is for ranking only))."""
    bound, mass = _page_scores(cfg, state, q, implementation, stacked)
    return _rank(cfg, state, bound, mass, implementation), mass


def _rank(cfg, state, bound, mass, implementation):
    """`_select`'s candidate pages [B, Hkv, C] from the page scores (bound [B, Hkv,
    G, N], mass [B, Hkv, N], `lookup_ref.page_scores`). The "cpu" implementation
    ranks in C++ (cpu_kernels/selection.cc): the same pages from the same scores."""
    if cfg.sticky:
        # The last step's pages are favoured by sticky_nats in both rankings, so a
        # near-tie at the budget's edge does not swap pages every step.
        held = state.last_selected
        ranked = jnp.where(held, mass + cfg.sticky_nats, mass)
        bound = jnp.where(held[:, :, None, :], bound + cfg.sticky_nats, bound)
    else:
        ranked = mass
    k = min(cfg.candidate_pages, cfg.max_pages)
    g = cfg.gqa_group
    # Bound pages per query head: at least one when bound_share > 0, never more than k.
    per_head = round(k * cfg.bound_share) // g
    if cfg.bound_share > 0:
        per_head = max(1, per_head)
    per_head = min(per_head, k // g, bound.shape[-1])
    peak = cfg.peak_pages > 0 and cfg.budget_tokens != FULL_BUDGET
    lead = cfg.quest_lead_pages if cfg.budget_tokens != FULL_BUDGET else 0
    # Plain Quest's top pages lead a group's candidates (`extra` [B, Hkv] of them) when
    # its bounds are peaked, or always (quest_lead); see below.
    extra = (jnp.maximum(_peak_pages(cfg, bound, k) if peak else 0, lead)
             if peak or lead else None)
    if resolve_implementation(implementation, cfg) == "cpu":  # the same pages, in C++
        from cpu_kernels import ops
        lead_pages = jnp.broadcast_to(0 if extra is None else extra, bound.shape[:2])
        return ops.rank_pages(bound, ranked, state.page_table, lead_pages, per_head=per_head,
                              k=k, quest=extra is not None)
    top_b, pages_b = jax.lax.top_k(bound, per_head)       # [B, Hkv, G, per_head]
    # Spans (needles) are not page-aligned: the pages either side of each head's
    # top bound page often hold the span's tail, whose few tokens neither the bound
    # nor the centre ranks high. They come right after the bound picks.
    n_pages = bound.shape[-1]
    # (The top page by argmax and candidates by the page table, not from top_k's
    # outputs: slicing those made XLA:CPU's top_k over the bound 3x slower, 7 -> 22
    # ms per step at 128K.)
    side = _first_argmax(bound)[..., None] + jnp.array([-1, 1])  # [B, Hkv, G, 2]
    side_ok = (side >= 0) & (side < n_pages)
    side = jnp.clip(side, 0, n_pages - 1)
    side_ok &= state.page_table[jnp.arange(side.shape[0])[:, None, None, None], side] >= 0
    top_b = jnp.concatenate([jnp.where(top_b > -jnp.inf, 2.0, -jnp.inf),
                             jnp.where(side_ok, 1.5, -jnp.inf)], axis=-1)
    pages_b = jnp.concatenate([pages_b, side], axis=-1)
    top_b = top_b.reshape(*top_b.shape[:2], -1)
    pages_b = pages_b.reshape(*pages_b.shape[:2], -1)
    if peak or lead:
        # Peaked bounds (issue 14): when a head's bound sets pages far apart from
        # its bulk, it has more contenders than its split holds, and the centre
        # cannot judge them (a range wide in a few channels has a centre near zero
        # there). The group then takes Quest's own top pages (the group's maximum
        # bound) first, cfg.peak_pages per far page, up to all k: the candidates hold
        # what plain Quest would attend (and the digest's rounding may rank a few
        # of its pages past the budget), and the re-rank's exact scores choose.
        # (Quest's top-k only when some group needs it: XLA:CPU's top_k over the
        # pages costs about 0.6 ms per step at 128K.)
        # Every group leads with `lead` of them (cfg.quest_lead): its floor can
        # then always reach Quest's set, with or without a far page.
        kq = k

        def quest(bound):
            top_q, pages_q = jax.lax.top_k(jnp.max(bound, axis=2), kq)  # [B, Hkv, kq]
            use_q = (jnp.arange(kq) < extra[..., None]) & (top_q > -jnp.inf)
            return jnp.where(use_q, 3.0 - jnp.arange(kq) / kq, -jnp.inf), pages_q

        def no_quest(bound):
            shape = bound.shape[:2] + (kq,)
            return jnp.full(shape, -jnp.inf, top_b.dtype), jnp.zeros(shape, pages_b.dtype)

        top_q, pages_q = (quest(bound) if lead > 0 else
                          jax.lax.cond(jnp.any(extra > 0), quest, no_quest, bound))
        top_b = jnp.concatenate([top_q, top_b], axis=-1)
        pages_b = jnp.concatenate([pages_q, pages_b], axis=-1)
    # A page picked twice is kept once (`dup` marks its other copies): its best copy,
    # Quest's picks before bound picks before side pages before invalid entries.
    rank = jnp.where(top_b > 2.0, 0, jnp.where(top_b == 2.0, 1, jnp.where(top_b > -jnp.inf, 2, 3)))
    order = jnp.argsort(pages_b * 4 + rank, axis=-1)
    sorted_pages = jnp.take_along_axis(pages_b, order, axis=-1)
    dup_sorted = jnp.concatenate([jnp.zeros_like(sorted_pages[..., :1], bool),
                                  sorted_pages[..., 1:] == sorted_pages[..., :-1]], axis=-1)
    dup = jnp.zeros_like(dup_sorted).at[
        jnp.arange(dup_sorted.shape[0])[:, None, None],
        jnp.arange(dup_sorted.shape[1])[None, :, None], order].set(dup_sorted)
    b_i = jnp.arange(mass.shape[0])[:, None, None]
    h_i = jnp.arange(mass.shape[1])[None, :, None]
    taken = jnp.where(top_b > -jnp.inf, pages_b, n_pages)
    lists_p, lists_s = [pages_b], [jnp.where(dup, -jnp.inf, top_b)]
    # Then the pages with the most estimated group mass, among those not yet taken,
    # fill the budget: exactly k slots, bound pages first, centre pages by rank.
    center = ranked.at[b_i, h_i, taken].set(-jnp.inf, mode="drop")
    top_c, pages_c = jax.lax.top_k(center, k)
    lists_p.append(pages_c)
    lists_s.append(jnp.where(top_c > -jnp.inf, 1.0 - jnp.arange(k) / k, -jnp.inf))
    priority = jnp.concatenate(lists_s, axis=-1)
    top, pick = jax.lax.top_k(priority, k)
    logical = jnp.take_along_axis(jnp.concatenate(lists_p, axis=-1), pick, axis=-1)
    ok = top > -jnp.inf  # NaN scores (NaN keys) stay in their own sequence
    # In page order (none last): the attention's gathers then walk the pool forwards.
    logical = jnp.where(ok, logical, n_pages)
    logical = jnp.sort(logical, axis=-1)
    return jnp.where(logical < n_pages, logical, -1).astype(jnp.int32)


PEAK_STATS_STRIDE = 8  # the mean and spread from every 8th page: a 1,000-page sample at 128K


def _peak_pages(cfg, bound, k):
    """[B, Hkv] int32: how many of plain Quest's top pages lead a group's
    candidates: cfg.peak_pages per (query head, page) whose bound lies more than
    cfg.peak_z lower semi-deviations above the head's mean, at most k. (The spread
    below the mean, so that the far pages do not widen it; both from a strided
    sample of the pages at 4,096 pages or more: half the time at 128K.)"""
    x = bound[..., ::PEAK_STATS_STRIDE] if bound.shape[-1] >= 512 * PEAK_STATS_STRIDE else bound
    ok = x > -jnp.inf  # NaN (NaN keys) and non-candidates are left out
    mean = (row_sum(jnp.where(ok, x, 0.0))[..., None]
            / jnp.maximum(jnp.sum(ok, axis=-1, keepdims=True), 1))
    below = ok & (x < mean)
    dev = jnp.where(below, x - mean, 0.0)
    sd = jnp.sqrt(row_sum(dev * dev)[..., None]
                  / jnp.maximum(jnp.sum(below, axis=-1, keepdims=True), 1))
    # NaN bounds compare False: a poisoned page is never far.
    far = bound - mean > cfg.peak_z * jnp.maximum(sd, 1e-6)
    return jnp.minimum(cfg.peak_pages * jnp.sum(far, axis=(2, 3)), k).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _selection_mask(n_pages: int, pages: jax.Array) -> jax.Array:
    b, h, _ = pages.shape
    return jnp.zeros((b, h, n_pages), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
        jnp.where(pages >= 0, pages, n_pages)].set(True, mode="drop")


def remember(cfg: HiSparseConfig, state: CacheState, pages: jax.Array) -> CacheState:
    """The state after a decode step whose candidates were `pages` [B, Hkv, C]
    (logical, -1 = none): the next step's selection favours them by
    `cfg.sticky_nats`, so the candidate set (what offload keeps resident) does not
    flicker. `decode_step` and the caches do this every step; a caller of the
    other pure functions does too, or gets a fresh selection every step."""
    if not cfg.sticky:
        return state
    return state.replace(last_selected=_selection_mask(state.last_selected.shape[-1], pages))


# Share of the sample drawn uniformly (the rest follows the digest's mass
# estimate): it caps every page's weight at N / (n * share), so a page the digest
# underrates cannot blow up the estimate. 0.1-0.5 measured alike on concentrated
# heads (docs/results.md); 0 would trust the digest alone.
TAIL_UNIFORM_SHARE = 0.25
_TAIL_KEY = 0x7A11
_RERANK_KEY = 0x7A12


def _offsets(cfg, seq_lens, salt, shape):
    """[B, *shape] uniform offsets in [0, 1) that change once per page of decode steps."""
    window = jnp.maximum(seq_lens, 0) // cfg.page_size
    return jax.vmap(lambda w: jax.random.uniform(
        jax.random.fold_in(jax.random.key(salt), w), shape))(window)


# A sequence's numbers must not depend on how many sequences the step computes
# (`state.decode_widths`): its sums over its own axes go through `row_sum`, never
# `jnp.sum`, whose order on XLA:CPU depends on the number of rows.
row_sum = decode_ref.row_sum


def head_sum(x: jax.Array) -> jax.Array:
    """x [B, Hkv, G, ...] summed over the group's heads (`row_sum`)."""
    return row_sum(jnp.moveaxis(x, 2, -1))


def _systematic(cdf, u, n):
    """n systematic draws from each row's distribution: cdf [R, N] (not normalized),
    u [R] offsets in [0, 1) -> indices [R, n] (clipped to N - 1)."""
    points = (u[:, None] + jnp.arange(n)) / n * cdf[:, -1:]
    idx = jax.vmap(functools.partial(jnp.searchsorted, side="right"))(cdf, points)
    return jnp.minimum(idx, cdf.shape[-1] - 1)


def sample_tail(cfg: HiSparseConfig, mass: jax.Array, pages: jax.Array, seq_lens: jax.Array, *,
                implementation=None):
    """An importance sample of the cold pages selection left out (MagicPIG's idea
    at page granularity), `cfg.sample_pages` draws per (sequence, KV head) in two
    systematic samples: n_u = 1/4 of them uniform over the candidate pages (a draw
    that lands on a selected page is dropped), n_s = 3/4 over the unselected pages
    in proportion s to the digest's estimated mass. A drawn page x is weighted
    1 / (n_u / C + n_s s_x), its expected number of draws, so attention over the
    drawn pages with these weights is an unbiased estimate of the unselected
    pages' softmax numerator and denominator: their mass is estimated, not dropped.

    The offsets are a function of the sequence's cold page count, so they hold
    for a page's worth of decode steps: the uniform draws stay the same pages
    (offload mode keeps them on the device meanwhile) and every implementation
    draws the same.

    mass [B, Hkv, N] log estimated mass (-inf = not a candidate); pages [B, Hkv, K]
    the selection. Returns (logical pages [B, Hkv, n] int32, -1 = none, and their
    log weights [B, Hkv, n] f32, 0 where none). The "cpu" implementation draws
    in C++ (`cpu_kernels.ops.sample_tail`)."""
    n = cfg.sample_pages
    b, h, npg = mass.shape
    if n == 0:
        return jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), jnp.float32)
    n_u = round(n * TAIL_UNIFORM_SHARE)
    n_s = n - n_u
    if resolve_implementation(implementation, cfg) == "cpu":
        from cpu_kernels import ops
        return ops.sample_tail(mass, pages, _offsets(cfg, seq_lens, _TAIL_KEY, (2, h)),
                               n_u=n_u, n_s=n_s)
    cand = mass > -jnp.inf  # NaN estimates (NaN keys) are never drawn
    free = cand.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
                   jnp.where(pages >= 0, pages, npg)].set(False, mode="drop")
    top = jnp.max(jnp.where(free, mass, -jnp.inf), axis=-1, keepdims=True)
    share = jnp.where(free, jnp.exp(mass - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    share = share / jnp.maximum(row_sum(share)[..., None], 1e-30)
    n_cand = jnp.sum(cand, axis=-1, keepdims=True)
    u = _offsets(cfg, seq_lens, _TAIL_KEY, (2, h))  # [B, 2, Hkv]
    draws = [_systematic(jnp.cumsum(x, axis=-1).reshape(b * h, npg), u[:, i].reshape(-1), k)
             for i, (x, k) in enumerate(((cand.astype(jnp.float32), n_u), (share, n_s))) if k]
    idx = jnp.concatenate(draws, axis=-1).reshape(b, h, n)
    expected = n_u * free / jnp.maximum(n_cand, 1) + n_s * share  # draws per page
    e_idx = jnp.take_along_axis(expected, idx, axis=-1)
    ok = jnp.take_along_axis(free, idx, axis=-1) & (e_idx > 0)
    logw = jnp.where(ok, -jnp.log(jnp.where(ok, e_idx, 1.0)), 0.0)
    return jnp.where(ok, idx, -1).astype(jnp.int32), logw.astype(jnp.float32)


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
        # the floor cost about 3 ms per step at 32K on XLA:CPU.
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
    1/8): with it the floor protected the wrong edge pages (docs/results.md).
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
    """(out, attended logical pages [B, Hkv, min(C, K)]). stacked: (the
    layer-stacked state that `state` is a view of, the layer), whose tiers and pool
    the "cpu" kernels read in place."""
    if sample is None:
        sample = jnp.zeros(logical.shape[:2] + (0,), jnp.int32)
        sample_logw = jnp.zeros(sample.shape, jnp.float32)
    tiers, layer = stacked or (state, None)
    cold = tuple(getattr(tiers, f) for f in COLD_FIELDS)
    out, kept = attend_cold_slots(cfg, state, q, cold, pool_pages(state.page_table, logical),
                                  pool_pages(state.page_table, sample), sample_logw, layer,
                                  tiers if stacked else None, implementation=implementation)
    return out, take_or_none(logical, kept)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def attend_cold_slots(cfg: HiSparseConfig, state: CacheState, q: jax.Array, cold: tuple,
                      slots: jax.Array, sample_slots: jax.Array, sample_logw: jax.Array,
                      layer=None, stacked: CacheState | None = None, *, implementation=None):
    """Decode attention whose cold pages are read from `cold` (arrays laid out like
    the state's pool, COLD_FIELDS order): the candidates at `slots` [B, Hkv, C]
    (-1 = none), re-ranked down to `cfg.budget_pages` (`rerank`) when there are
    more, and the sampled pages at `sample_slots` [B, Hkv, n], each weighted by
    exp(sample_logw) [B, Hkv, n]. `cold` is the state's own pool, or an offload
    working set. With `layer`, `cold` is a layer-stacked pool and `stacked` the
    layer-stacked state that `state` is a view of: the "cpu" kernels read that
    layer of both in place (a custom call's operand cannot be a slice, and XLA
    would copy the layer's pool for one); the others slice them.

    -> (out [B, Hq, D] float32, NaN for poisoned sequences; kept [B, Hkv, min(C, K)]:
    the attended candidates, as indices into `slots`, -1 = none)."""
    out, kept = _attend_cold_slots(cfg, state, q, cold, slots, sample_slots, sample_logw,
                                   layer, stacked, implementation)
    return jnp.where(state.poisoned[:, None, None], jnp.nan, out), kept


def _attend_cold_slots(cfg, state, q, cold, slots, sample_slots, sample_logw, layer, stacked,
                       implementation):
    impl = resolve_implementation(implementation, cfg)
    if layer is not None and (impl != "cpu" or stacked is None):
        cold, layer, stacked = tuple(a[layer] for a in cold), None, None  # sliced in gathers
    # Without a tail sample the weights are constant zeros inside decode_attention's
    # jit, and XLA folds `logits + 0` into a different op order than the offload
    # path, which passes them at run time; the barrier keeps both bit-equal.
    sample_logw = jax.lax.optimization_barrier(sample_logw)
    bf16_pos, fp8_pos = slot_positions(cfg, state.seq_lens)
    qg = group_queries(cfg, q).astype(jnp.float32)
    tiers = state if stacked is None else stacked  # stacked: the "cpu" kernels' in place
    window = (qg, tiers.bf16_k, tiers.bf16_v, bf16_pos >= 0, tiers.fp8_k, tiers.fp8_v,
              tiers.fp8_k_scale, tiers.fp8_v_scale, fp8_pos >= 0)
    sm_scale = 1.0 / math.sqrt(cfg.head_dim)
    if impl == "cpu":
        return _attend_cpu(cfg, state, qg, window, cold, slots, sample_slots, sample_logw,
                           layer, sm_scale)
    c = slots.shape[-1]
    if c <= cfg.budget_pages:  # every candidate is attended
        kept = jnp.where(slots >= 0, jnp.arange(c, dtype=jnp.int32), -1)
        ids = jnp.concatenate([slots, sample_slots], axis=-1)
        logw = jnp.concatenate([jnp.zeros(slots.shape, jnp.float32), sample_logw], axis=-1)
        out = _ops(impl, cfg)[1](*window, *cold, ids, sm_scale=sm_scale, cold_logw=logw)[0]
        return out.reshape(q.shape), kept
    int4_k, int4_v, int4_v_scale, int4_v_zero, center, radius = cold
    # Candidates and sample in one list: for XLA one gather and dot for both.
    listed = jnp.concatenate([slots, sample_slots], axis=-1)
    raw = decode_ref.cold_logits(qg, int4_k, center, radius,
                                 slots if impl == "pallas" else listed)
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
    if impl == "pallas":  # the kernel reads the attended pages' keys again
        out = _ops(impl, cfg)[1](*window, *cold, ids, sm_scale=sm_scale, cold_logw=logw)[0]
        return out.reshape(q.shape), kept
    # XLA: the attended pages' logits are reused, not recomputed.
    logits = decode_ref.weighted_logits(
        jnp.take_along_axis(raw, jnp.maximum(picked, 0)[:, :, None, :, None], axis=3),
        ids, logw, sm_scale)
    parts = decode_ref.window_parts(*window, sm_scale)
    parts.append(decode_ref.attend_cold_logits(logits, int4_v, int4_v_scale, int4_v_zero, ids))
    return decode_ref.merge_parts(parts)[0].reshape(q.shape), kept


def _attend_cpu(cfg, state, qg, window, cold, slots, sample_slots, sample_logw, layer,
                sm_scale):
    """`_attend_cold_slots` on the C++ kernels (cpu_kernels/): the window's softmax,
    the listed pages' logits, the re-rank, and one kernel for the
    rest of the arithmetic (`attend_listed`)."""
    from cpu_kernels import ops
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
                stacked=None):
    """`decode_attention` as a decode step: (out [B, Hq, D], attended logical pages
    [B, Hkv, K], the state after `remember`ing this step's candidates).
    stacked: see `_attend_logical`."""
    sel = select(cfg, state, q, implementation=implementation, stacked=stacked)
    out, pages = _attend_logical(cfg, state, q, sel.pages, sel.sample, sel.sample_logw,
                                 implementation, stacked)
    return out, pages, remember(cfg, state, sel.pages)


def decode_layer(cfg: HiSparseConfig, stacked: CacheState, layer, q, k, v, active, *,
                 implementation=None):
    """One layer of a model's decode step on a layer-stacked state
    (`state.init_stacked`), in place: append each active sequence's k, v [B, Hkv,
    D] (`state.append_layer`), attend with q [B, Hq, D] (`decode_step`) and
    remember its candidates (all a decode step changes besides the append).
    -> (out [B, Hq, D] float32, stacked)."""
    stacked = append_layer(cfg, stacked, layer, k, v, active, implementation=implementation)[0]
    # The "cpu" kernels read the layer's tiers and pool in the stacked arrays.
    cpu = resolve_implementation(implementation, cfg) == "cpu"
    out, _, after = decode_step(cfg, layer_view(cfg, stacked, layer), q,
                                implementation=implementation,
                                stacked=(stacked, layer) if cpu else None)
    return out, stacked.replace(
        last_selected=stacked.last_selected.at[layer].set(after.last_selected))


@jax.jit
def dense_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           lengths: jax.Array) -> jax.Array:
    """Exact attention on unquantized K/V: the quality and speed baseline.

    q [B, Hq, D]; k, v [B, Hkv, S, D] (any float dtype, read as is); lengths [B].
    returns [B, Hq, D] float32.
    """
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(k.dtype)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    logits = jnp.where(valid, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(valid, p, 0.0)
    out = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, d)


def causal_query_block(qi: jax.Array, kv_block, i: jax.Array, chunk: int) -> jax.Array:
    """Exact causal attention of query block i over key blocks 0..i: the one body
    of every exact prefill (`causal_prefill_attention`, and the serving engine's
    block-by-block prefill, which must give the same numbers).

    qi [Hkv, G*C, D] float32, already scaled by 1/sqrt(D), rows ordered (group,
    position), so that each KV head is one plain matmul (the [C, Hkv, G, D] layout
    transposed operands in every block: 2.2x slower here,
    `benchmarks/prefill_attention_variants.py`); kv_block(j) -> (k, v) [Hkv, C, D]
    float32, key block j. Online softmax over the key blocks. -> [Hkv, G*C, D].
    """
    hkv, rows, d = qi.shape
    qpos = jnp.tile(jnp.arange(chunk), rows // chunk)

    def step(carry, j, diagonal: bool):
        m, l, acc = carry
        k, v = kv_block(j)
        s = jnp.einsum("hqd,hkd->hqk", qi, k)
        if diagonal:  # only the diagonal block has future keys
            s = jnp.where(jnp.arange(chunk)[None, :] <= qpos[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        return (m_new, l * corr + jnp.sum(p, -1),
                acc * corr[..., None] + jnp.einsum("hqk,hkd->hqd", p, v))

    init = (jnp.full((hkv, rows), -jnp.inf), jnp.zeros((hkv, rows)), jnp.zeros((hkv, rows, d)))
    # the blocks before the diagonal unmasked (a mask there keeps every key: 14%
    # of a 7.5K prompt's attention, `benchmarks/prefill_attention_variants.py`)
    carry = jax.lax.fori_loop(0, i, lambda j, c: step(c, j, False), init)
    _, l, acc = step(carry, i, True)
    return acc / l[..., None]


def query_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """Query block q [C, Hq, D] -> [Hkv, G*C, D] float32 scaled by 1/sqrt(D), as
    `causal_query_block` takes it."""
    c, hq, d = q.shape
    g = hq // num_kv_heads
    q = q.astype(jnp.float32) * (1.0 / math.sqrt(d))
    return q.reshape(c, num_kv_heads, g, d).transpose(1, 2, 0, 3).reshape(num_kv_heads, g * c, d)


def query_rows_back(out: jax.Array, chunk: int) -> jax.Array:
    """`causal_query_block`'s [Hkv, G*C, D] -> [C, Hq, D]."""
    hkv, rows, d = out.shape
    g = rows // chunk
    return out.reshape(hkv, g, chunk, d).transpose(2, 0, 1, 3).reshape(chunk, hkv * g, d)


@functools.partial(jax.jit, static_argnames=("chunk",))
def causal_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                             chunk: int = 512) -> jax.Array:
    """Exact causal attention for a prompt, chunked so memory is O(chunk^2), not O(T^2).

    q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D] float32. T must be a multiple of
    `chunk` (pad the prompt; padded keys come after every real query, so causality
    already hides them). Online softmax over key chunks, skipping chunks in the
    future (`causal_query_block`).
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    n = t // chunk
    qb = jax.vmap(lambda x: query_rows(x, hkv))(q.reshape(n, chunk, hq, d))
    kc, vc = (x.astype(jnp.float32).reshape(n, chunk, hkv, d).transpose(0, 2, 1, 3)
              for x in (k, v))
    out = jax.lax.map(
        lambda a: query_rows_back(causal_query_block(a[1], lambda j: (kc[j], vc[j]), a[0], chunk), chunk),
        (jnp.arange(n), qb))
    return out.reshape(t, hq, d)
