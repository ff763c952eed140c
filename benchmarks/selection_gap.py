"""Where the selection's gap to the oracle comes from, and what closing it would
cost (docs/results.md, "The gap to the oracle"). Selection only: recall of the
pages each variant picks, against the oracle under the same budget.

    python benchmarks/selection_gap.py --context 131072 --seed 12 --queries 16
    python benchmarks/selection_gap.py --context 32768 --seed 11 --mixed-groups
    python benchmarks/selection_gap.py --time-rerank 131072

Variants (each a change to the estimated group mass that ranks the centre picks;
the bound picks and side pages are the shipped ones):
- digest: the shipped selection (page-centre logits, per-head softmax shares);
- page_mean: the centre logit replaced by the page's mean key (as a stored
  offset from the centre it would cost 8 more bytes per token per KV head);
- window_weights: each head's shares scaled by its estimated cold share, from
  its exact window log-sum-exp and the centres (what the oracle's group sum
  weighs heads by);
- rerank_xM: a ceiling for re-ranking with the int4 keys. The shipped selection
  at M x the budget, then the budget's worth of those with the most exact mass.
`--mixed-groups` gives each KV head's query heads four different kinds, as in
trained models, instead of one kind per group.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import attention
from hisparse_jax.bench import _time_interleaved
from hisparse_jax.cache import HiSparseCache
from hisparse_jax.config import HiSparseConfig, preset
from hisparse_jax.evaluation import ExactMass, config_for
from hisparse_jax.workloads import CONCENTRATED, HEAD_KINDS, make_workload
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.sparse_decode import reference as decode_ref

SHIPPED_SCORES = lookup_ref.page_scores


def scores_with(mass_logits, head_offset=None):
    """A page_scores whose group mass ranks pages by mass_logits(q, center, radius,
    page_table) [Hkv, B, G, P] (per-head logits), each head's softmax shares shifted
    by head_offset(center_logits, radius_logits) [Hkv, B, G, 1] (log weight)."""
    def page_scores(q, center, radius, page_table):
        bound, _ = SHIPPED_SCORES(q, center, radius, page_table)
        qs = (q.astype(jnp.float32) / math.sqrt(q.shape[-1])).transpose(1, 0, 2, 3)
        ok = page_table[None, :, None, :] >= 0
        x = jnp.where(ok, mass_logits(qs, center, radius, page_table), -jnp.inf)
        shares = x - jax.nn.logsumexp(x, axis=3, keepdims=True)
        if head_offset is not None:
            shares = shares + head_offset(x)
        mass = jnp.where(ok, jax.nn.logsumexp(shares, axis=2, keepdims=True), -jnp.inf)
        return bound, mass[:, :, 0].transpose(1, 0, 2)
    return page_scores


def pool_dot(rows, pool, page_table):  # [Hkv, B, G, D] . [Hkv, P, D] -> [Hkv, B, G, N]
    s = jnp.einsum("hbgd,hpd->hbgp", rows.astype(jnp.bfloat16), pool.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return jnp.take_along_axis(s, jnp.maximum(page_table, 0)[None, :, None, :], axis=3)


def select_each(cfg, state, q):
    """Selected logical pages [N, Hkv, K], one query at a time, with whatever
    page_scores lookup_ref holds now (a new jit: it is read at trace time)."""
    pick = jax.jit(lambda st, qi: attention._select(cfg, st, qi, "xla")[0])
    return np.stack([np.asarray(pick(state, jnp.asarray(q[i:i + 1]))[0])
                     for i in range(q.shape[0])])


def row(name, w, cfg, exact, pages, oracle):
    kinds = np.array(w.head_kinds)
    r = exact.recall(pages)
    conc = np.isin(kinds, CONCENTRATED)
    out = {"variant": name, "concentrated_recall": round(float(r[:, conc].mean()), 4),
           "concentrated_oracle": round(float(oracle[:, conc].mean()), 4),
           "all_vs_oracle": round(float(r.mean() / oracle.mean()), 4)}
    for kind in HEAD_KINDS:
        m = kinds == kind
        if m.any():
            out[f"{kind}_vs_oracle"] = round(float(r[:, m].mean() / oracle[:, m].mean()), 4)
    return out


def quality(args):
    kinds = None
    if args.mixed_groups:
        kinds = [HEAD_KINDS[(h + g) % len(HEAD_KINDS)] for h in range(4) for g in range(4)]
    w = make_workload(context=args.context, num_kv_heads=4, gqa_group=4, head_dim=128,
                      num_queries=args.queries, seed=args.seed, kinds=kinds)
    q, k, v = (np.asarray(x, np.float32) for x in (w.q, w.k, w.v))
    cfg = config_for(HiSparseConfig(), k, 4)
    cache = HiSparseCache(cfg, "xla")
    cache.prefill(0, k, v)
    state = cache.state
    exact = ExactMass.compute(cfg, q, k)
    oracle = exact.recall(exact.oracle(cfg.budget_pages))
    common = {"context": args.context, "seed": args.seed, "mixed_groups": args.mixed_groups}

    def emit(name, pages):
        print(json.dumps({**common, **row(name, w, cfg, exact, pages, oracle)}), flush=True)

    emit("digest", select_each(cfg, state, q))

    # The page's mean key, stored as an e4m3 offset from the range centre.
    pg, npg = cfg.page_size, k.shape[0] // cfg.page_size
    table = np.asarray(state.page_table[0, :npg])
    live = table >= 0
    kp = k[:npg * pg].reshape(npg, pg, *k.shape[1:])
    offset = kp.mean(1) - (kp.min(1) + kp.max(1)) / 2          # [npg, Hkv, D]
    pool_offset = np.zeros(state.digest_center.shape, np.float32)
    pool_offset[:, table[live]] = offset[live].transpose(1, 0, 2)
    pool_offset = jnp.asarray(pool_offset).astype(jnp.float8_e4m3fn)
    lookup_ref.page_scores = scores_with(
        lambda qs, c, r, t: pool_dot(qs, c, t) + pool_dot(qs, pool_offset, t))
    emit("page_mean", select_each(cfg, state, q))

    # Heads weighted by their estimated cold share: the window's exact log-sum-exp
    # (sink/hot/warm keys, float32 here) against the centres' estimate of the rest.
    kw = jnp.asarray(k[exact.always]).transpose(1, 0, 2)      # [Hkv, T, D]
    pages = []
    for i in range(q.shape[0]):
        qg = jnp.asarray(q[i]).reshape(4, 1, 4, -1) / math.sqrt(k.shape[-1])
        window = jax.nn.logsumexp(jnp.einsum("hbgd,htd->hbgt", qg, kw), axis=-1)[..., None]

        def cold_share(x, window=window):
            cold = jax.nn.logsumexp(x, axis=3, keepdims=True) + math.log(pg)
            return cold - jnp.logaddexp(cold, window)
        lookup_ref.page_scores = scores_with(lambda qs, c, r, t: pool_dot(qs, c, t), cold_share)
        pages.append(select_each(cfg, state, q[i:i + 1])[0])
    emit("window_weights", np.stack(pages))
    lookup_ref.page_scores = SHIPPED_SCORES

    group = exact.page_mass.reshape(q.shape[0], 4, 4, -1).sum(axis=2)  # oracle's objective
    for mult in args.rerank:
        wide = select_each(cfg.replace(budget_tokens=int(cfg.budget_pages * mult) * pg), state, q)
        gm = np.where(wide >= 0, np.take_along_axis(group, np.maximum(wide, 0), -1), -1.0)
        best = np.argsort(-gm, axis=-1)[..., :cfg.budget_pages]
        emit(f"rerank_x{mult}", np.take_along_axis(wide, best, -1))


def time_rerank(context, extra=(32, 64), repeats=15):
    """Median ms, calls interleaved, random K/V, default preset (128 selected + 32
    sampled pages per KV head): the decode step; its cold attention as shipped;
    scoring 128 + e candidates' int4 keys alone (an unfused re-rank adds this);
    and a fused re-rank that scores 128 + e candidates, keeps the 128 with the most
    group mass, and reuses their logits, reading values for those and the sample
    only (a prototype of the XLA path, not shipped, built from the reference's own
    `cold_logits` / `cold_values`)."""
    cfg = preset("default").replace(max_context=context, max_seqs=1, num_pool_pages=None)
    h, d, k, n = cfg.num_kv_heads, cfg.head_dim, cfg.budget_pages, cfg.sample_pages
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((context, h, d), np.float32), jnp.bfloat16)
    cache = HiSparseCache(cfg, "xla")
    cache.prefill(0, kv, kv)
    st = cache.state
    q = jnp.asarray(rng.standard_normal((1, cfg.num_q_heads, d), np.float32))
    qg = attention.group_queries(cfg, q)
    sm = 1.0 / math.sqrt(d)
    # The shipped reference's own pieces (pallas_kernels/sparse_decode/reference.py).
    k4, v4, vs, vz, center, radius = (getattr(st, f) for f in attention.COLD_FIELDS)

    def logits_of(ids):  # [B, Hkv, K] pool pages -> scaled logits [B, Hkv, G, K, page]
        return decode_ref.cold_logits(qg, k4, center, radius, ids) * sm

    @jax.jit
    def shipped_cold(ids, logw):
        return decode_ref.attend_cold(qg, k4, v4, vs, vz, center, radius, ids, logw, sm)

    @jax.jit
    def score_only(cand):
        return jax.nn.logsumexp(logits_of(cand), axis=-1)

    @jax.jit
    def fused(cand, sample, sample_logw):
        logits = logits_of(cand)
        shares = jax.nn.logsumexp(logits, axis=-1)
        shares = shares - jax.nn.logsumexp(shares, axis=-1, keepdims=True)
        _, pick = jax.lax.top_k(jax.nn.logsumexp(shares, axis=2), k)   # [B, Hkv, K]
        ids = jnp.concatenate([jnp.take_along_axis(cand, pick, -1), sample], axis=-1)
        logits = jnp.concatenate([
            jnp.take_along_axis(logits, pick[:, :, None, :, None], axis=3),
            logits_of(sample) + sample_logw[:, :, None, :, None]], axis=3)
        p = jnp.exp(logits - jnp.max(logits, axis=(-2, -1), keepdims=True))
        return decode_ref.cold_values(p, v4, vs, vz, ids) / p.sum(axis=(-2, -1))[..., None]

    def pages(m):
        return jnp.asarray(rng.integers(0, cfg.pool_pages, (1, h, m)), jnp.int32)
    shipped, sample, logw = pages(k + n), pages(n), jnp.zeros((1, h, n), jnp.float32)
    fns = {"decode_step": lambda: attention.decode_attention(cfg, st, q, implementation="xla"),
           f"cold_attention_{k}+{n}": lambda: shipped_cold(shipped, jnp.zeros((1, h, k + n)))}
    for e in extra:
        cand = pages(k + e)
        fns[f"score_{k + e}_pages_alone"] = lambda cand=cand: score_only(cand)
        fns[f"fused_rerank_{k + e}_to_{k}+{n}"] = lambda cand=cand: fused(cand, sample, logw)
    times = _time_interleaved(list(fns.values()), repeats)
    print(json.dumps({"context": context, **{f"{name}_ms": round(ms, 2)
                                             for name, (ms, _) in zip(fns, times)}}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--mixed-groups", action="store_true")
    p.add_argument("--rerank", type=float, nargs="*", default=[1.25, 1.5, 2.0],
                   help="candidate multiples of the budget for the re-rank ceiling")
    p.add_argument("--time-rerank", type=int, metavar="CONTEXT",
                   help="instead: time a decode step, its cold attention, and re-ranks "
                        "over 1.25x and 1.5x the budget's pages (alone and fused)")
    args = p.parse_args(argv)
    if args.time_rerank:
        time_rerank(args.time_rerank)
    else:
        try:
            quality(args)
        finally:  # the variants patch the module's page_scores
            lookup_ref.page_scores = SHIPPED_SCORES


if __name__ == "__main__":
    main()
