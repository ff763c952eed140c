"""Attention entry points: page selection, sparse decode, dense references, prefill.

`implementation=None | "xla" | "pallas"` picks the kernel (None: Pallas on GPU
when the kernels take the cache's shapes, XLA otherwise: `resolve_implementation`).
Both compute the same function; the XLA path is the reference.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hisparse_jax.config import HiSparseConfig, resolve_implementation
from hisparse_jax.state import CacheState, slot_positions
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.sparse_decode import reference as decode_ref


def _ops(implementation, cfg: HiSparseConfig):
    """(page_scores, sparse_decode) for an implementation name."""
    if resolve_implementation(implementation, cfg) == "pallas":
        from pallas_kernels.lookup import kernel as lookup_kernel
        from pallas_kernels.sparse_decode import kernel as decode_kernel
        return lookup_kernel.page_scores, decode_kernel.sparse_decode
    return lookup_ref.page_scores, decode_ref.sparse_decode


def group_queries(cfg: HiSparseConfig, q: jax.Array) -> jax.Array:
    """[B, Hq, D] -> [B, Hkv, G, D]; query head i reads KV head i // G."""
    return q.reshape(q.shape[0], cfg.num_kv_heads, cfg.gqa_group, cfg.head_dim)


class Selection(NamedTuple):
    """What one decode step attends per (sequence, KV head), beside sink/hot/warm."""
    pages: jax.Array        # [B, Hkv, K] int32 selected logical pages, -1 = none
    sample: jax.Array       # [B, Hkv, n] int32 sampled unselected pages, -1 = none
    sample_logw: jax.Array  # [B, Hkv, n] f32 log importance weight of each sample entry


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def select(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *,
           implementation=None) -> Selection:
    """The selected cold pages (`select_pages`) and an importance sample of the
    others (`sample_tail`)."""
    pages, mass = _select(cfg, state, q, implementation)
    sample, logw = sample_tail(cfg, mass, pages, state.seq_lens)
    return Selection(pages, sample, logw)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def select_pages(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *, implementation=None):
    """The cold pages to attend per (sequence, KV head): each query head's top
    pages by Quest's upper bound (a `bound_share` of the budget split between
    the group's heads), then the two pages beside each head's top bound page (a
    span's tail), then the pages with the most estimated group mass. The pages of
    `state.last_selected` (the last step's, see `remember`) score
    `cfg.sticky_nats` higher in both rankings.

    q [B, Hq, D] -> (logical pages [B, Hkv, K] int32, pool pages [B, Hkv, K] int32,
    -1 where fewer than K cold pages exist). Sink, hot and warm pages have no page
    table entry, so they are never candidates.
    """
    logical, _ = _select(cfg, state, q, implementation)
    return logical, pool_pages(state.page_table, logical)


@jax.jit
def pool_pages(page_table: jax.Array, logical: jax.Array) -> jax.Array:
    """Pool page of each logical page: page_table [B, N], logical [B, Hkv, K] (-1 kept)."""
    pool = jnp.take_along_axis(page_table[:, None, :], jnp.maximum(logical, 0), axis=2)
    return jnp.where(logical >= 0, pool, -1).astype(jnp.int32)


def _select(cfg, state, q, implementation):
    """(selected logical pages [B, Hkv, K], estimated group mass of every page
    [B, Hkv, N] (log, -inf = not a candidate; without the stickiness bonus, which
    is for ranking only))."""
    page_scores, _ = _ops(implementation, cfg)
    bound, mass = page_scores(group_queries(cfg, q), state.digest_center,
                              state.digest_radius, state.page_table)
    if cfg.sticky:
        # The last step's pages are favoured by sticky_nats in both rankings, so a
        # near-tie at the budget's edge does not swap pages every step.
        held = state.last_selected
        ranked = jnp.where(held, mass + cfg.sticky_nats, mass)
        bound = jnp.where(held[:, :, None, :], bound + cfg.sticky_nats, bound)
    else:
        ranked = mass
    k = min(cfg.budget_pages, cfg.max_pages)
    g = cfg.gqa_group
    # Bound pages per query head: at least one when bound_share > 0, never more than k.
    per_head = round(k * cfg.bound_share) // g
    if cfg.bound_share > 0:
        per_head = max(1, per_head)
    per_head = min(per_head, k // g, bound.shape[-1])
    top_b, pages_b = jax.lax.top_k(bound, per_head)       # [B, Hkv, G, per_head]
    # Spans (needles) are not page-aligned: the pages either side of each head's
    # top bound page often hold the span's tail, whose few tokens neither the bound
    # nor the centre ranks high. They come right after the bound picks.
    n_pages = bound.shape[-1]
    # (The top page by argmax and candidates by the page table, not from top_k's
    # outputs: slicing those made XLA:CPU's top_k over the bound 3x slower, 7 -> 22
    # ms per step at 128K.)
    side = jnp.argmax(bound, axis=-1)[..., None] + jnp.array([-1, 1])  # [B, Hkv, G, 2]
    side_ok = (side >= 0) & (side < n_pages)
    side = jnp.clip(side, 0, n_pages - 1)
    side_ok &= state.page_table[jnp.arange(side.shape[0])[:, None, None, None], side] >= 0
    top_b = jnp.concatenate([jnp.where(top_b > -jnp.inf, 2.0, -jnp.inf),
                             jnp.where(side_ok, 1.5, -jnp.inf)], axis=-1)
    pages_b = jnp.concatenate([pages_b, side], axis=-1)
    top_b = top_b.reshape(*top_b.shape[:2], -1)
    pages_b = pages_b.reshape(*pages_b.shape[:2], -1)
    # A page picked by several heads is kept once (`dup` marks its other copies): its
    # best copy, bound picks before side pages before invalid entries.
    rank = jnp.where(top_b == 2.0, 0, jnp.where(top_b > -jnp.inf, 1, 2))
    order = jnp.argsort(pages_b * 4 + rank, axis=-1)
    sorted_pages = jnp.take_along_axis(pages_b, order, axis=-1)
    dup_sorted = jnp.concatenate([jnp.zeros_like(sorted_pages[..., :1], bool),
                                  sorted_pages[..., 1:] == sorted_pages[..., :-1]], axis=-1)
    dup = jnp.zeros_like(dup_sorted).at[
        jnp.arange(dup_sorted.shape[0])[:, None, None],
        jnp.arange(dup_sorted.shape[1])[None, :, None], order].set(dup_sorted)
    # Then the pages with the most estimated group mass, among those not yet taken,
    # fill the budget: exactly k slots, bound pages first, centre pages by rank.
    b_i = jnp.arange(mass.shape[0])[:, None, None]
    h_i = jnp.arange(mass.shape[1])[None, :, None]
    center = ranked.at[b_i, h_i, jnp.where(top_b > -jnp.inf, pages_b, n_pages)].set(
        -jnp.inf, mode="drop")
    top_c, pages_c = jax.lax.top_k(center, k)
    priority = jnp.concatenate([
        jnp.where(dup, -jnp.inf, top_b),
        jnp.where(top_c > -jnp.inf, 1.0 - jnp.arange(k) / k, -jnp.inf)], axis=-1)
    top, pick = jax.lax.top_k(priority, k)
    logical = jnp.take_along_axis(jnp.concatenate([pages_b, pages_c], axis=-1), pick, axis=-1)
    ok = top > -jnp.inf  # NaN scores (NaN keys) stay in their own sequence
    return jnp.where(ok, logical, -1).astype(jnp.int32), mass


@functools.partial(jax.jit, static_argnums=0)
def _selection_mask(n_pages: int, pages: jax.Array) -> jax.Array:
    b, h, _ = pages.shape
    return jnp.zeros((b, h, n_pages), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
        jnp.where(pages >= 0, pages, n_pages)].set(True, mode="drop")


def remember(cfg: HiSparseConfig, state: CacheState, pages: jax.Array) -> CacheState:
    """The state after a decode step that selected `pages` [B, Hkv, K] (logical, -1 =
    none): the next step's selection favours them by `cfg.sticky_nats`. The cache
    calls this after every `attend`; a caller of the pure functions does too, or
    gets a fresh selection every step."""
    if not cfg.sticky:
        return state
    return state.replace(last_selected=_selection_mask(state.last_selected.shape[-1], pages))


# Share of the sample drawn uniformly (the rest follows the digest's mass
# estimate): it caps every page's weight at N / (n * share), so a page the digest
# underrates cannot blow up the estimate. 0.1-0.5 measured alike on concentrated
# heads (docs/results.md); 0 would trust the digest alone.
TAIL_UNIFORM_SHARE = 0.25
_TAIL_KEY = 0x7A11


def _systematic(cdf, u, n):
    """n systematic draws from each row's distribution: cdf [R, N] (not normalized),
    u [R] offsets in [0, 1) -> indices [R, n] (clipped to N - 1)."""
    points = (u[:, None] + jnp.arange(n)) / n * cdf[:, -1:]
    idx = jax.vmap(functools.partial(jnp.searchsorted, side="right"))(cdf, points)
    return jnp.minimum(idx, cdf.shape[-1] - 1)


def sample_tail(cfg: HiSparseConfig, mass: jax.Array, pages: jax.Array, seq_lens: jax.Array):
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
    log weights [B, Hkv, n] f32, 0 where none)."""
    n = cfg.sample_pages
    b, h, npg = mass.shape
    if n == 0:
        return jnp.zeros((b, h, 0), jnp.int32), jnp.zeros((b, h, 0), jnp.float32)
    n_u = round(n * TAIL_UNIFORM_SHARE)
    n_s = n - n_u
    cand = mass > -jnp.inf  # NaN estimates (NaN keys) are never drawn
    free = cand.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
                   jnp.where(pages >= 0, pages, npg)].set(False, mode="drop")
    top = jnp.max(jnp.where(free, mass, -jnp.inf), axis=-1, keepdims=True)
    share = jnp.where(free, jnp.exp(mass - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    share = share / jnp.maximum(jnp.sum(share, axis=-1, keepdims=True), 1e-30)
    n_cand = jnp.sum(cand, axis=-1, keepdims=True)
    window = jnp.maximum(seq_lens, 0) // cfg.page_size
    u = jax.vmap(lambda w: jax.random.uniform(
        jax.random.fold_in(jax.random.key(_TAIL_KEY), w), (2, h)))(window)  # [B, 2, Hkv]
    draws = [_systematic(jnp.cumsum(x, axis=-1).reshape(b * h, npg), u[:, i].reshape(-1), k)
             for i, (x, k) in enumerate(((cand.astype(jnp.float32), n_u), (share, n_s))) if k]
    idx = jnp.concatenate(draws, axis=-1).reshape(b, h, n)
    expected = n_u * free / jnp.maximum(n_cand, 1) + n_s * share  # draws per page
    e_idx = jnp.take_along_axis(expected, idx, axis=-1)
    ok = jnp.take_along_axis(free, idx, axis=-1) & (e_idx > 0)
    logw = jnp.where(ok, -jnp.log(jnp.where(ok, e_idx, 1.0)), 0.0)
    return jnp.where(ok, idx, -1).astype(jnp.int32), logw.astype(jnp.float32)


COLD_FIELDS = ("int4_k", "int4_v", "int4_v_scale", "int4_v_zero", "digest_center",
               "digest_radius")


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def attend_pages(cfg: HiSparseConfig, state: CacheState, q: jax.Array, logical: jax.Array,
                 sample: jax.Array | None = None, sample_logw: jax.Array | None = None, *,
                 implementation=None) -> jax.Array:
    """Decode attention over sink + hot + warm + the given cold pages (+ an
    importance sample of the others, weighted by exp(sample_logw)).

    q [B, Hq, D]; logical [B, Hkv, K] logical page ids (-1 = none; pages that are
    not cold are ignored); sample, sample_logw [B, Hkv, n] (`sample_tail`)
    -> out [B, Hq, D] float32.
    """
    logical, logw = with_sample(logical, sample, sample_logw)
    pool = pool_pages(state.page_table, logical)
    cold = tuple(getattr(state, f) for f in COLD_FIELDS)
    return attend_cold_slots(cfg, state, q, cold, pool, logw, implementation=implementation)


def with_sample(pages, sample=None, sample_logw=None):
    """(the selected pages followed by the sample entries [B, Hkv, K + n], their log
    weights: 0 for selected pages)."""
    if sample is None:
        return pages, jnp.zeros(pages.shape, jnp.float32)
    return (jnp.concatenate([pages, sample], axis=-1),
            jnp.concatenate([jnp.zeros(pages.shape, jnp.float32), sample_logw], axis=-1))


@functools.partial(jax.jit, static_argnames=("cfg", "implementation"))
def attend_cold_slots(cfg: HiSparseConfig, state: CacheState, q: jax.Array, cold: tuple,
                      slots: jax.Array, slot_logw: jax.Array, *, implementation=None
                      ) -> jax.Array:
    """Decode attention whose cold pages are read from `cold` (arrays laid out like
    the state's pool, COLD_FIELDS order) at `slots` [B, Hkv, K] (-1 = none), each
    weighted by exp(slot_logw) [B, Hkv, K]: the state's own pool, or an offload
    working set."""
    _, sparse_decode = _ops(implementation, cfg)
    # Without a tail sample the weights are constant zeros inside decode_attention's
    # jit, and XLA folds `logits + 0` into a different op order than the offload
    # path, which passes them at run time; the barrier keeps both bit-equal.
    slot_logw = jax.lax.optimization_barrier(slot_logw)
    bf16_pos, fp8_pos = slot_positions(cfg, state.seq_lens)
    out, _ = sparse_decode(
        group_queries(cfg, q).astype(jnp.float32), state.bf16_k, state.bf16_v, bf16_pos >= 0,
        state.fp8_k, state.fp8_v, state.fp8_k_scale, state.fp8_v_scale, fp8_pos >= 0,
        *cold, slots, sm_scale=1.0 / math.sqrt(cfg.head_dim), cold_logw=slot_logw)
    return out.reshape(q.shape[0], cfg.num_q_heads, cfg.head_dim)


@functools.partial(jax.jit, static_argnames=("cfg", "implementation", "return_selection"))
def decode_attention(cfg: HiSparseConfig, state: CacheState, q: jax.Array, *,
                     implementation=None, return_selection=False):
    """HiSparse decode attention for one query per sequence, after its last append.

    q: [B, Hq, D] -> out [B, Hq, D] float32 (zeros for empty sequences).
    With return_selection, also the selected logical pages [B, Hkv, K] (the
    sampled ones are not part of it). The selection favours the pages of
    `state.last_selected`; `remember(cfg, state, pages)` makes this step's the
    next step's (the cache does it in `attend`).
    """
    sel = select(cfg, state, q, implementation=implementation)
    out = attend_pages(cfg, state, q, sel.pages, sel.sample, sel.sample_logw,
                       implementation=implementation)
    return (out, sel.pages) if return_selection else out


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


@functools.partial(jax.jit, static_argnames=("chunk",))
def causal_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                             chunk: int = 512) -> jax.Array:
    """Exact causal attention for a prompt, chunked so memory is O(chunk^2), not O(T^2).

    q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D] float32. T must be a multiple of
    `chunk` (pad the prompt; padded keys come after every real query, so causality
    already hides them). Online softmax over key chunks, skipping chunks in the future.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    n = t // chunk
    scale = 1.0 / math.sqrt(d)
    qc = q.astype(jnp.float32).reshape(n, chunk, hkv, g, d)
    kc = k.astype(jnp.float32).reshape(n, chunk, hkv, d)
    vc = v.astype(jnp.float32).reshape(n, chunk, hkv, d)
    local = jnp.arange(chunk)

    def one_query_chunk(i, qi):
        def body(j, carry):
            m, l, acc = carry
            s = jnp.einsum("qhgd,khd->hgqk", qi, kc[j]) * scale
            causal = (j * chunk + local)[None, :] <= (i * chunk + local)[:, None]
            s = jnp.where(causal, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return (m_new, l * corr + jnp.sum(p, -1),
                    acc * corr[..., None] + jnp.einsum("hgqk,khd->hgqd", p, vc[j]))

        init = (jnp.full((hkv, g, chunk), -jnp.inf), jnp.zeros((hkv, g, chunk)),
                jnp.zeros((hkv, g, chunk, d)))
        _, l, acc = jax.lax.fori_loop(0, i + 1, body, init)
        return (acc / l[..., None]).transpose(2, 0, 1, 3).reshape(chunk, hq, d)

    out = jax.lax.map(lambda a: one_query_chunk(*a), (jnp.arange(n), qc))
    return out.reshape(t, hq, d)
