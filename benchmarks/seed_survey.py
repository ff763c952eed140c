"""Quantization error and logit range of each head kind over many workload seeds
(docs/log/results.md, "Generator fix"): a number measured on one seed is not luck.

    python benchmarks/seed_survey.py --context 32768 --seeds 0 1 2 3 4 5 6 7 8 9
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.harness.evaluation import evaluate
from hisparse_jax.harness.workloads import HEAD_KINDS, make_workload


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--queries", type=int, default=8)
    args = p.parse_args()
    for seed in args.seeds:
        w = make_workload(context=args.context, num_kv_heads=4, gqa_group=4, head_dim=128,
                          num_queries=args.queries, seed=seed)
        ev = evaluate(HiSparseConfig(), w.q, w.k, w.v)
        g = w.q.shape[1] // w.k.shape[1]
        logits = np.einsum("nhd,shd->nhs", w.q, np.repeat(w.k, g, axis=1)) / np.sqrt(128)
        kinds = np.array(w.head_kinds)
        row = {"seed": seed, "quant_error_mean": ev.summary()["quant_error_mean"],
               "quant_error_p95": ev.summary()["quant_error_p95"]}
        for kind in HEAD_KINDS:
            heads = np.flatnonzero(kinds == kind)
            row[kind] = {"quant_error_mean": float(ev.quant_error[:, heads].mean()),
                         "logit_max": float(logits[:, heads].max())}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
