"""`hisparse bench scheduler`: offload residency, predictive policy vs LRU
(`hisparse_jax.harness.traces.bench_scheduler`)."""

from __future__ import annotations

import json
import sys

from hisparse_jax.cli.args import (
    choice_list,
    int_at_least,
    int_list,
    nonnegative_int,
    number,
    number_list,
)
from hisparse_jax.harness.traces import bench_scheduler

TRACE_KINDS = ("drift", "retrieval")
MIN_CONTEXT = 4096


def main_bench_scheduler(args) -> list[dict]:
    rows = bench_scheduler(context=args.context, steps=args.steps, seed=args.seed,
                           step_noise=args.step_noise, step_overlap=args.step_overlap,
                           layer_noise=args.layer_noise,
                           kinds=args.traces, max_prefetch=tuple(args.max_prefetch),
                           oracle=args.oracle, sticky_nats=args.sticky_nats,
                           multiples=tuple(args.multiples),
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    for r in rows:  # every row, the oracle's too
        r["command"] = args.command_line
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        hdr = ("trace", "W", "policy", "hit rate", "MiB/step (h2d)", "prefetched", "evictions")
        out = [(r["trace"], f"{r['working_set_multiple']}x", r["policy"], f"{r['hit_rate']:.3f}",
                f"{r['h2d_bytes_per_step'] / 2**20:.2f}" if "fetched" in r else "-",
                r.get("prefetched", "-"), r.get("evictions", "-")) for r in rows]
        w = [max(len(str(h)), *(len(str(o[i])) for o in out)) for i, h in enumerate(hdr)]
        print("  ".join(str(h).ljust(x) for h, x in zip(hdr, w)))
        for o in out:
            print("  ".join(str(c).ljust(x) for c, x in zip(o, w)))
    return rows


def add_scheduler_bench_parser(bench_subparsers):
    """Adds `scheduler` under `hisparse bench` (sets func=main_bench_scheduler)."""
    s = bench_subparsers.add_parser("scheduler", help="offload residency: predictive policy vs "
                                                      "LRU hit rate and host->device bytes")
    s.add_argument("--context", type=int_at_least(MIN_CONTEXT), default=32768,
                   help=f"tokens (>= {MIN_CONTEXT}: the selection needs cold pages to choose "
                        "from)")
    s.add_argument("--steps", type=int_at_least(2), default=256,
                   help="decode steps (>= 2: hit rates compare consecutive steps)")
    s.add_argument("--seed", type=nonnegative_int, default=0)
    s.add_argument("--traces", type=choice_list(TRACE_KINDS), default=TRACE_KINDS,
                   help="comma-separated trace kinds: drift, retrieval")
    s.add_argument("--oracle", action="store_true",
                   help="also Belady's MIN (future-knowing eviction, no prefetch) as a bound")
    s.add_argument("--multiples", type=number_list(1.0), default=[1, 2, 4],
                   help="working sets to measure, in multiples (>= 1) of a step's "
                        "candidate pages")
    s.add_argument("--max-prefetch", type=int_list(0), default=[32],
                   help="comma-separated prefetch limits per (sequence, KV head) per step "
                        "for the predictive policy (a sweep: 8,16,32,64)")
    s.add_argument("--step-overlap", type=number(0.0, above=True, below=1.0), default=0.70,
                   help="share of pages consecutive steps select in common; the per-step "
                        "query jitter is solved for it (0.70: the low end of published "
                        "70-100%%)")
    s.add_argument("--step-noise", type=number(0.0), default=None,
                   help="a fixed per-step query jitter (x query norm) instead of "
                        "--step-overlap")
    s.add_argument("--layer-noise", type=number(0.0), default=0.3,
                   help="adjacent-layer query jitter (x query norm)")
    s.add_argument("--sticky-nats", type=number(0.0), default=None,
                   help="how much selection favours the last step's pages (default: the "
                        "preset's; 0 = every step selected afresh)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=main_bench_scheduler)
    return s
