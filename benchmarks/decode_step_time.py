"""How long a serving engine's decode step takes with a few of its slots active.

One `Engine` (HiSparse) of --max-seqs slots, each prefilled with --context tokens
of the GPL's text; then, for each --active count, warm-up steps and the median
of --steps timed `decode_step`s over the first that many slots. A step runs the
narrowest compiled width that covers them (`Engine.decode_width`), so this is
what one request (or a few) costs in a server of --max-seqs slots:

    python benchmarks/decode_step_time.py --context 1000 --max-seqs 8 --active 1,8

Another tree side by side (docs/log/serving.md, "Decode width"): run the same
command from a git worktree of it with PYTHONPATH=that worktree, alternating.
--set FIELD=N ... overrides the cache config (e.g. `--set value_group=32
hot_tokens=128`, the served tiers before 57b5c15). --pool-scoring-ratio R sets
the lookup's `POOL_SCORING_RATIO` before anything compiles (0: always gather
each sequence's digest rows; a large R: always score the whole pool), to compare
its two paths in a server's engine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load
from pallas_kernels.lookup import reference as lookup_ref

TEXT = "/usr/share/common-licenses/GPL-3"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=1000, help="prompt tokens per slot")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--budget", type=int, default=512, help="decode budget (tokens)")
    p.add_argument("--active", default="1,8", help="active slot counts, comma-separated")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-scoring-ratio", type=float, default=None,
                   help="the lookup's POOL_SCORING_RATIO (default: the shipped one)")
    p.add_argument("--set", nargs="+", default=[], metavar="FIELD=N",
                   help="integer cache config overrides")
    args = p.parse_args(argv)
    try:
        overrides = {k: int(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    except ValueError:
        p.error(f"--set {' '.join(args.set)}: expected FIELD=N (integers)")
    if args.pool_scoring_ratio is not None:
        lookup_ref.POOL_SCORING_RATIO = args.pool_scoring_ratio
    active = [int(a) for a in args.active.split(",")]
    if not all(1 <= a <= args.max_seqs for a in active):
        p.error(f"--active {args.active}: counts must be in [1, {args.max_seqs}]")
    model, tok = load(args.model)
    with open(TEXT) as f:
        ids = tok.encode(f.read())
    if len(ids) < args.context + 50 * args.max_seqs:
        p.error(f"--context {args.context}: the text has {len(ids)} tokens")
    e = Engine(model, max_seqs=args.max_seqs, max_context=args.context + 512,
               budget_tokens=args.budget, cache_overrides=overrides)
    for b in range(args.max_seqs):  # other text in every slot
        e.prefill(b, ids[50 * b:50 * b + args.context])
    for a in active:
        mask = np.arange(args.max_seqs) < a
        for _ in range(args.warmup):
            e.decode_step(mask)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            e.decode_step(mask)
            times.append(time.perf_counter() - t)
        print(json.dumps({"active": a, "width": e.decode_width(mask),
                          "max_seqs": args.max_seqs, "context": args.context,
                          "budget": args.budget, "steps": args.steps, "set": overrides,
                          "pool_scoring_ratio": lookup_ref.POOL_SCORING_RATIO,
                          "median_step_ms": round(1000 * float(np.median(times)), 1)}),
              flush=True)


if __name__ == "__main__":
    main()
