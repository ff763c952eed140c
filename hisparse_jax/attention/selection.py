"""Page selection: score every cold page from its digest, rank the candidates,
sample the tail (DESIGN.md §2.1).

`implementation=None | "xla" | "pallas" | "cpu"` picks the kernels (None: Pallas
on a GPU, the C++ kernels of cpu_kernels/ on the CPU, where each takes the cache's
shapes, XLA otherwise: `hisparse_jax.backends`). All compute the same function;
the XLA path is the reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hisparse_jax import backends
from hisparse_jax.cache.state import CacheState, layer_view
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.sparse_decode import reference as decode_ref


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
           implementation=None, layer=None) -> Selection:
    """The candidate cold pages (`select_pages`) and an importance sample of the
    others (`sample_tail`). With `layer`, `state` is layer-stacked
    (`state.init_stacked`) and this selects in that layer: see `stacked_source`."""
    state, source = stacked_source(cfg, state, layer)
    pages, mass = _select(cfg, state, q, implementation, source)
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
    plain reductions: XLA:CPU runs a variadic argmax reduce slowly
    (docs/log/code-timings.md, "argmax")."""
    nan = jnp.isnan(x)
    top = jnp.where(jnp.any(nan, axis=-1, keepdims=True), jnp.nan, jnp.max(x, axis=-1,
                                                                          keepdims=True))
    hit = jnp.where(jnp.isnan(top), nan, x == top)
    n = x.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1) % n


def stacked_source(cfg: HiSparseConfig, state: CacheState, layer):
    """(the state to read, the source to read in place): with `layer`, layer
    `layer`'s view of the layer-stacked `state` and (state, layer); else (state,
    None). The ops' implementations take both: one that can index a layer itself
    (a C++ kernel, whose operand cannot be a slice: XLA would copy the layer's
    pool for one) reads the stacked arrays, the others read the view."""
    if layer is None:
        return state, None
    return layer_view(cfg, state, layer), (state, layer)


def _page_scores(cfg, state, q, implementation, stacked):
    """(bound, mass) of `lookup_ref.page_scores`. stacked: `stacked_source`'s."""
    backend = backends.resolve("page_scores", implementation, cfg=cfg)
    return backends.kernel("page_scores", backend)(group_queries(cfg, q), state,
                                                    stacked or (state, None))


@backends.register("page_scores", "xla")
def _page_scores_reference(qg, view, stacked):
    return lookup_ref.page_scores(qg, view.digest_center, view.digest_radius, view.page_table)


@backends.register("page_scores", "pallas", why_not=backends.pallas_why_not)
def _page_scores_pallas(qg, view, stacked):
    from pallas_kernels.lookup import kernel
    return kernel.page_scores(qg, view.digest_center, view.digest_radius, view.page_table)


@backends.register("page_scores", "cpu", why_not=backends.cpu_decode_why_not)
def _page_scores_cpu(qg, view, stacked):
    """Reads the digests of a layer-stacked state in place."""
    from cpu_kernels import ops
    digests, layer = stacked
    return ops.page_scores(qg, digests.digest_center, digests.digest_radius, view.page_table,
                           layer=layer)


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
    backend = backends.resolve("rank_pages", implementation, cfg=cfg)
    return backends.kernel("rank_pages", backend)(cfg, state, bound, ranked, extra, per_head, k,
                                                  peak, lead)


@backends.register("rank_pages", "cpu", why_not=backends.cpu_decode_why_not)
def _rank_pages_cpu(cfg, state, bound, ranked, extra, per_head, k, peak, lead):
    """`_rank_pages_reference`'s pages, in C++ (cpu_kernels/selection.cc)."""
    from cpu_kernels import ops
    lead_pages = jnp.broadcast_to(0 if extra is None else extra, bound.shape[:2])
    return ops.rank_pages(bound, ranked, state.page_table, lead_pages, per_head=per_head,
                          k=k, quest=extra is not None)


@backends.register("rank_pages", "xla")
def _rank_pages_reference(cfg, state, bound, ranked, extra, per_head, k, peak, lead):
    """The candidates from the scores (`_rank`): bound pages per head and the pages
    beside each head's top one, plain Quest's top pages first where `extra` says,
    then the best estimated group mass (`ranked`), k in all, in page order."""
    top_b, pages_b = jax.lax.top_k(bound, per_head)       # [B, Hkv, G, per_head]
    # Spans (needles) are not page-aligned: the pages either side of each head's
    # top bound page often hold the span's tail, whose few tokens neither the bound
    # nor the centre ranks high. They come right after the bound picks.
    n_pages = bound.shape[-1]
    # (The top page by argmax and candidates by the page table, not from top_k's
    # outputs: slicing those slowed XLA:CPU's top_k over the bound down;
    # docs/log/code-timings.md, "top_k outputs".)
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
        # (Quest's top-k only when some group needs it: a top_k over every page
        # is not free; docs/log/code-timings.md, "Quest's top-k".)
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
    b_i = jnp.arange(ranked.shape[0])[:, None, None]
    h_i = jnp.arange(ranked.shape[1])[None, :, None]
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
# heads (docs/log/results.md); 0 would trust the digest alone.
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
    b, h = mass.shape[:2]
    if n == 0:
        return jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), jnp.float32)
    n_u = round(n * TAIL_UNIFORM_SHARE)
    n_s = n - n_u
    backend = backends.resolve("sample_tail", implementation, cfg=cfg)
    return backends.kernel("sample_tail", backend)(cfg, mass, pages, seq_lens, n_u, n_s)


@backends.register("sample_tail", "cpu", why_not=backends.cpu_decode_why_not)
def _sample_tail_cpu(cfg, mass, pages, seq_lens, n_u, n_s):
    """`_sample_tail_reference`'s draws, in C++ (`cpu_kernels.ops.sample_tail`)."""
    from cpu_kernels import ops
    h = mass.shape[1]
    return ops.sample_tail(mass, pages, _offsets(cfg, seq_lens, _TAIL_KEY, (2, h)),
                           n_u=n_u, n_s=n_s)


@backends.register("sample_tail", "xla")
def _sample_tail_reference(cfg, mass, pages, seq_lens, n_u, n_s):
    b, h, npg = mass.shape
    n = n_u + n_s
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
