"""Selection variants on the generated workloads (the tables in docs/log/results.md).

    python benchmarks/selection_sweep.py --context 32768 --seeds 1 2 --bound-shares 0 0.25 0.5 0.75 1
    python benchmarks/selection_sweep.py --context 131072 --seeds 12 --queries 16 \
        --tail-samples 0 16 32 64 --uniform-shares 0.1 0.25 0.5 1
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from hisparse_jax import attention
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness.evaluation import evaluate, needle_pages_hit, needles_found
from hisparse_jax.harness.workloads import CONCENTRATED, make_workload


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--bound-shares", type=float, nargs="+", default=[0.75])
    p.add_argument("--tail-samples", type=int, nargs="+", default=[32],
                   help="tail_sample_pages values (0 = no tail estimate)")
    p.add_argument("--uniform-shares", type=float, nargs="+",
                   default=[attention.TAIL_UNIFORM_SHARE],
                   help="uniform share of the sampling proposal (attention.TAIL_UNIFORM_SHARE)")
    args = p.parse_args()
    for seed in args.seeds:
        w = make_workload(context=args.context, num_kv_heads=4, gqa_group=4, head_dim=128,
                          num_queries=args.queries, seed=seed)
        kinds = np.array(w.head_kinds)
        for share in args.bound_shares:
            for n in args.tail_samples:
                for uniform in (args.uniform_shares if n else [0.0]):
                    attention.TAIL_UNIFORM_SHARE = uniform
                    jax.clear_caches()  # traces read the module constant
                    cfg = HiSparseConfig(bound_share=share, tail_sample_pages=n)
                    ev = evaluate(cfg, w.q, w.k, w.v)
                    conc = ev.summary(np.flatnonzero(np.isin(kinds, CONCENTRATED)))
                    diffuse = ev.summary(np.flatnonzero(kinds == "diffuse"))
                    print(json.dumps({
                        "context": args.context, "seed": seed, "bound_share": share,
                        "tail_sample_pages": n, "uniform_share": uniform,
                        "concentrated_recall": round(conc["recall_mean"], 4),
                        "concentrated_selection_error": round(conc["selection_error_mean"], 4),
                        "concentrated_unsampled_error":
                            round(conc["unsampled_selection_error_mean"], 4),
                        "diffuse_selection_error": round(diffuse["selection_error_mean"], 4),
                        "diffuse_recall_vs_oracle": round(diffuse["recall_vs_oracle"], 4),
                        "needles_found": needles_found(ev, w.needle_targets),
                        "needle_pages_1pct": needle_pages_hit(ev, w.needle_targets, 0.01)}),
                        flush=True)


if __name__ == "__main__":
    main()
