"""Where the selection's gap to the oracle comes from, and what closing it
costs (docs/log/results.md, "The gap to the oracle"). Selection only: recall of the
pages each variant attends, against the oracle under the same budget.

    python benchmarks/selection_gap.py --context 131072 --seed 12 --queries 16
    python benchmarks/selection_gap.py --context 32768 --seed 11 --mixed-groups
    python benchmarks/selection_gap.py --time-rerank 131072

Variants:
- shipped: the default config, the re-rank included (the pages
  `decode_attention` attends);
- digest: the digest's ranking alone (rerank_multiple=1): page-centre logits,
  per-head softmax shares. The next two change how it ranks the centre picks
  (the bound picks and side pages stay):
- page_mean: the centre logit replaced by the page's mean key (as a stored
  offset from the centre it would cost 8 more bytes per token per KV head);
- window_weights: each head's shares scaled by its estimated cold share, from
  its exact window log-sum-exp and the centres (what the oracle's group sum
  weighs heads by);
- rerank_xM: a ceiling for the re-rank: the digest's selection at M x the
  budget, then the budget's worth of those with the most exact (unquantized) mass.
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
from hisparse_jax.attention import selection
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import HiSparseConfig, preset
from hisparse_jax.harness.attention_bench import _time_interleaved, random_decode_case
from hisparse_jax.harness.evaluation import ExactMass, config_for
from hisparse_jax.harness.workloads import CONCENTRATED, HEAD_KINDS, make_workload
from pallas_kernels.lookup import reference as lookup_ref

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
    page_scores lookup_ref holds now (a new jit: it is read at trace time). With
    the re-rank on, the pages the attention keeps of the candidates."""
    def pick(st, qi):
        if cfg.candidate_pages > cfg.budget_pages:
            return attention.decode_attention(cfg, st, qi, implementation="xla",
                                              return_selection=True)[1]
        return selection._select(cfg, st, qi, "xla")[0]
    pick = jax.jit(pick)
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
    shipped = config_for(HiSparseConfig(), k, 4)
    cfg = shipped.replace(rerank_multiple=1)  # the digest's own ranking
    cache = HiSparseCache(cfg, "xla")
    cache.prefill(0, k, v)
    state = cache.state
    exact = ExactMass.compute(cfg, q, k)
    oracle = exact.recall(exact.oracle(cfg.budget_pages))
    common = {"context": args.context, "seed": args.seed, "mixed_groups": args.mixed_groups}

    def emit(name, pages):
        print(json.dumps({**common, **row(name, w, cfg, exact, pages, oracle)}), flush=True)

    emit("shipped", select_each(shipped, state, q))
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


def time_rerank(context, multiples=(1, 1.25, 1.5), repeats=15):
    """Median ms of the decode step at each re-rank multiple (1 = off) and of
    dense attention, as `hisparse bench attention` runs them: random K/V, default
    preset, every step right after a dense call (so its digests are not in cache)."""
    cfg = preset("default").replace(max_context=context, max_seqs=1, num_pool_pages=None)
    st, q, dense = random_decode_case(cfg, context)
    fns = []
    for m in multiples:
        c = cfg.replace(rerank_multiple=m)
        fns += [dense, lambda c=c: attention.decode_attention(c, st, q, implementation="xla")]
    times = [ms for ms, _ in _time_interleaved(fns, repeats)]
    dense_ms = float(np.median(times[0::2]))
    row = {"context": context, "dense_ms": round(dense_ms, 2)}
    for m, ms in zip(multiples, times[1::2]):
        row[f"step_rerank_x{m}_ms"] = round(ms, 2)
        row[f"speedup_rerank_x{m}"] = round(dense_ms / ms, 2)
    print(json.dumps(row))


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
                   help="instead: time the decode step without a re-rank and with "
                        "1.25x and 1.5x the budget's pages as candidates, against dense")
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
