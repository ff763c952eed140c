"""Selection on sharp heads (issue 14): per head, the recall of HiSparse's
attended pages against plain Quest's and the oracle's at the same budget.

    python benchmarks/sharp_heads.py --context 8192 --gqa 3 --seeds 0 1 2 3
    python benchmarks/sharp_heads.py --qkv captured.npz           # a capture (hisparse eval's format)
    python benchmarks/sharp_heads.py --qkv captured.npz --budget-tokens 512 --per-head
    python benchmarks/sharp_heads.py --gqa 4 --seeds 0 1 2 --preset model   # the model engine's config

Plain Quest (`quest_pages`): per KV head, the budget's cold pages with the highest
group maximum of the upper bound sum_d max(q_d lo_d, q_d hi_d) over each page's
exact per-channel key range, attended in full (no re-rank, no sample). The
oracle keeps the pages with the most exact group mass (`ExactMass.oracle`). A
head is sharp when one cold page holds more than --sharp-mass of its exact
attention. Recall is the exact mass on the sink/hot/warm tokens and the
attended pages (`ExactMass.recall`), per (query, query head).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import attention
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import PRESETS, HiSparseConfig, preset
from hisparse_jax.harness.evaluation import ExactMass, config_for
from hisparse_jax.harness.workloads import make_sharp_workload

SHARP_MASS = 0.5


def cold_pages(cfg: HiSparseConfig, s: int) -> np.ndarray:
    """[P] bool: the pages of an s-token sequence that are selection candidates."""
    from hisparse_jax.harness.evaluation import always_attended
    pg = cfg.page_size
    npg = -(-s // pg)
    always = np.pad(always_attended(cfg, s), (0, npg * pg - s), constant_values=True)
    return ~always.reshape(npg, pg).any(-1)


def quest_bound(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Quest's upper bound [N, Hq, P] (scaled logits, -inf on pages that are not
    cold) from each page's exact per-channel key min and max."""
    s, hkv, d = k.shape
    n, hq, _ = q.shape
    pg = cfg.page_size
    npg = -(-s // pg)
    kp = np.pad(np.asarray(k, np.float32), ((0, npg * pg - s), (0, 0), (0, 0)),
                mode="edge").reshape(npg, pg, hkv, d)
    lo, hi = kp.min(1), kp.max(1)                                      # [P, Hkv, D]
    qg = np.asarray(q, np.float32).reshape(n, hkv, hq // hkv, d) / np.sqrt(d)
    b = np.einsum("nhgd,phd->nhgp", np.maximum(qg, 0), hi) + \
        np.einsum("nhgd,phd->nhgp", np.minimum(qg, 0), lo)
    b = np.where(cold_pages(cfg, s), b, -np.inf)
    return b.reshape(n, hq, npg)


def quest_pages(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray, budget_pages=None
                ) -> np.ndarray:
    """Plain Quest's selection [N, Hkv, K] (-1 = none): per KV head the K cold pages
    with the highest group max of `quest_bound` (K = cfg.budget_pages)."""
    hkv = k.shape[1]
    bound = quest_bound(cfg, q, k)
    n, hq, npg = bound.shape
    group = bound.reshape(n, hkv, hq // hkv, npg).max(axis=2)
    kk = min(budget_pages or cfg.budget_pages, npg)
    best = np.argsort(-group, axis=-1, kind="stable")[..., :kk]
    return np.where(np.isfinite(np.take_along_axis(group, best, -1)), best, -1)


def hisparse_pages(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """(attended pages [N, Hkv, K] (the re-rank's kept candidates), candidates
    [N, Hkv, C]) of a fresh cache holding k, v, one query at a time."""
    cache = HiSparseCache(cfg, "xla")
    cache.prefill(0, k, v)
    st = cache.state
    step = jax.jit(lambda qi: (attention.decode_attention(cfg, st, qi, implementation="xla",
                                                         return_selection=True)[1],
                               attention.select_pages(cfg, st, qi, implementation="xla")[0]))
    kept, cands = [], []
    for i in range(q.shape[0]):
        a, c = step(jnp.asarray(q[i:i + 1], jnp.float32))
        kept.append(np.asarray(a[0]))
        cands.append(np.asarray(c[0]))
    return np.stack(kept), np.stack(cands)


def compare(cfg: HiSparseConfig, q, k, v, sharp_mass=SHARP_MASS):
    """Per (query, query head) rows for the sharp ones, and the exact masses."""
    q = np.asarray(q, np.float32)
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    exact = ExactMass.compute(cfg, q, k)
    kept, cands = hisparse_pages(cfg, q, k, v)
    quest = quest_pages(cfg, q, k)
    ours_r, quest_r = exact.recall(kept), exact.recall(quest)
    oracle_r = exact.recall(exact.oracle(cfg.budget_pages))
    bound = quest_bound(cfg, q, k)
    group = bound.reshape(n, k.shape[1], g, -1).max(axis=2)
    rows = []
    for i, h in zip(*np.nonzero(exact.page_mass.max(-1) > sharp_mass)):
        top = int(exact.page_mass[i, h].argmax())
        hb = bound[i, h]
        rows.append({
            "query": int(i), "head": int(h), "top_page": top,
            "pages_back": int(-(-k.shape[0] // cfg.page_size) - 1 - top),
            "top_page_mass": round(float(exact.page_mass[i, h, top]), 4),
            "head_bound_rank": int((hb > hb[top]).sum()) + 1,
            "group_bound_rank": int((group[i, h // g] > group[i, h // g, top]).sum()) + 1,
            "candidate": bool(top in cands[i, h // g]), "attended": bool(top in kept[i, h // g]),
            "ours": round(float(ours_r[i, h]), 4), "quest": round(float(quest_r[i, h]), 4),
            "oracle": round(float(oracle_r[i, h]), 4)})
    return rows, {"ours": ours_r, "quest": quest_r, "oracle": oracle_r}


def summarize(rows, recalls, name, **extra):
    ours = np.array([r["ours"] for r in rows])
    quest = np.array([r["quest"] for r in rows])
    out = {"workload": name, **extra, "sharp_heads": len(rows),
           "ours_mean": round(float(ours.mean()), 4) if rows else None,
           "quest_mean": round(float(quest.mean()), 4) if rows else None,
           "oracle_mean": round(float(np.mean([r["oracle"] for r in rows])), 4) if rows else None,
           "ours_min_minus_quest": round(float((ours - quest).min()), 4) if rows else None,
           "below_quest": int((ours < quest - 1e-6).sum()),
           "all_heads_ours": round(float(recalls["ours"].mean()), 4),
           "all_heads_quest": round(float(recalls["quest"].mean()), 4),
           "all_heads_oracle": round(float(recalls["oracle"].mean()), 4)}
    return out


def config_overrides(pairs) -> dict:
    """--set FIELD=VALUE ... -> HiSparseConfig overrides (ints, or floats with a '.')."""
    over = {}
    for kv in pairs:
        key, val = kv.split("=")
        over[key] = float(val) if "." in val else int(val)
    return over


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qkv", help="an npz with q [N, Hq, D], k, v [S, Hkv, D]")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--gqa", type=int, default=3)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--kinds", nargs="+", help="per query head: sharp, local, diffuse")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--budget-tokens", type=int,
                   help="cold budget per KV head (default: a 16th of the context)")
    p.add_argument("--sharp-mass", type=float, default=SHARP_MASS)
    p.add_argument("--per-head", action="store_true", help="also print a row per sharp head")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS),
                   help="the config (\"model\": what models.Engine runs)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="config overrides (e.g. rerank_multiple=1)")
    args = p.parse_args(argv)
    over = config_overrides(args.set)
    if args.qkv:
        data = np.load(args.qkv)
        cases = [(args.qkv, data["q"], data["k"], data["v"], {})]
    else:
        cases = []
        for seed in args.seeds:
            w = make_sharp_workload(context=args.context, num_kv_heads=args.kv_heads,
                                    gqa_group=args.gqa, head_dim=args.head_dim,
                                    num_queries=args.queries, kinds=args.kinds, seed=seed)
            cases.append((f"sharp{args.context}_g{args.gqa}", w.q, w.k, w.v, {"seed": seed}))
    for name, q, k, v, extra in cases:
        s = k.shape[0]
        budget = args.budget_tokens or max(16, s // 16 // 16 * 16)
        base = preset(args.preset, budget_tokens=budget, **over)
        cfg = config_for(base, np.asarray(k), q.shape[1] // k.shape[1])
        rows, recalls = compare(cfg, q, k, v, args.sharp_mass)
        if args.per_head:
            for r in rows:
                print(json.dumps({"workload": name, **extra, **r}), flush=True)
        print(json.dumps(summarize(rows, recalls, name, **extra, budget_tokens=budget,
                                   preset=args.preset,
                                   **({"set": args.set} if args.set else {}))), flush=True)


if __name__ == "__main__":
    main()
