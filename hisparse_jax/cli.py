"""`hisparse` command line: demo, eval, bench."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import numpy as np


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _budget(text: str) -> int:
    from hisparse_jax.config import FULL_BUDGET
    if text == "all":
        return FULL_BUDGET
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget-tokens must be an int or 'all', got {text!r}")
    if n < 0:
        raise argparse.ArgumentTypeError("--budget-tokens must be >= 0")
    return n


def _int_list(minimum: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        if any(x < minimum for x in values):
            raise argparse.ArgumentTypeError(f"every value must be >= {minimum}, got {text!r}")
        return values
    return parse


def load_qkv(path: str):
    """q [N, Hq, D], k/v [S, Hkv, D] from an npz; float16 or float32."""
    try:
        data = np.load(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}")
    missing = {"q", "k", "v"} - set(data.files)
    if missing:
        raise SystemExit(f"error: {path} lacks arrays {sorted(missing)} (needs q, k, v)")
    q, k, v = data["q"], data["k"], data["v"]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (np.float16, np.float32):
            raise SystemExit(f"error: {name} must be float16 or float32, got {x.dtype}")
        if x.ndim != 3:
            raise SystemExit(f"error: {name} must be 3-D, got shape {x.shape}")
    if k.shape != v.shape:
        raise SystemExit(f"error: k {k.shape} and v {v.shape} must match")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise SystemExit(f"error: q {q.shape} must be [N, Hq, D] with Hq a multiple of "
                         f"k's {k.shape[1]} heads and D = {k.shape[2]}")
    if not (np.all(np.isfinite(q)) and np.all(np.isfinite(k)) and np.all(np.isfinite(v))):
        raise SystemExit("error: q, k and v must be finite")
    return q, k, v


def _print_table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def cmd_eval(args):
    from hisparse_jax.config import preset
    from hisparse_jax.evaluation import evaluate
    q, k, v = load_qkv(args.qkv)
    cfg = preset(args.preset)
    if args.budget_tokens is not None:
        cfg = cfg.replace(budget_tokens=args.budget_tokens)
    if args.tail_sample_pages is not None:
        cfg = cfg.replace(tail_sample_pages=args.tail_sample_pages)
    if args.rerank_multiple is not None:
        cfg = cfg.replace(rerank_multiple=args.rerank_multiple)
    if args.heads is not None and max(args.heads) >= q.shape[1]:
        raise SystemExit(f"error: --heads {max(args.heads)} is not a query head "
                         f"(q has {q.shape[1]})")
    _log(f"evaluating {q.shape[0]} queries over {k.shape[0]} tokens ...")
    implementation = None if args.implementation == "auto" else args.implementation
    try:
        ev = evaluate(cfg, q, k, v, implementation=implementation, log=_log)
    except ValueError as e:  # shapes the preset or the kernels cannot hold (e.g. odd head_dim)
        raise SystemExit(f"error: {e}")
    summary = ev.summary(args.heads, args.oracle_budgets or ())
    if args.json:
        print(json.dumps(summary))
        return
    rows = [(key, f"{val:.4f}") for key, val in summary.items() if not isinstance(val, dict)]
    rows += [(f"oracle_recall at {b} tokens", f"{val:.4f}")
             for b, val in summary.get("oracle_recall_at_budget", {}).items()]
    _print_table(rows, ("metric", "value"))


def cmd_bench_attention(args):
    from hisparse_jax.bench import bench_attention
    row = bench_attention(args.context, preset_name=args.preset, batch=args.batch,
                          repeats=args.repeats, tail_sample_pages=args.tail_sample_pages,
                          rerank_multiple=args.rerank_multiple, log=_log)
    row["command"] = args.command_line
    if args.json:
        print(json.dumps(row))
    else:
        _print_table([(row["case"], f"{row['dense_ms']:.2f}", f"{row['hisparse_ms']:.2f}",
                       f"{row['speedup']:.1f}x")], ("case", "dense ms", "hisparse ms", "speedup"))


def cmd_bench_kernels(args):
    from hisparse_jax import bench_kernels as bk
    try:
        plan = bk.plan(args.case, args.impl, args.ops, iters=args.iters, warmup=args.warmup)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    command = ["hisparse", "bench", "kernels", "--case", args.case, "--impl", args.impl,
               "--ops", args.ops]
    for flag, val in (("--iters", args.iters), ("--warmup", args.warmup), ("--json", args.json)):
        if val is not None:
            command += [flag, str(val)]
    to_file = args.json not in (None, "-")
    if to_file:
        try:  # before the run: a bad path fails now, not after minutes of device time
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w"):
                pass
        except OSError as e:
            raise SystemExit(f"error: cannot write {args.json}: {e}")
    rows = bk.run(plan, command=" ".join(shlex.quote(c) for c in command), log=_log)
    if args.json == "-":
        for row in rows:
            print(json.dumps(row))
        return
    if to_file:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        _log(f"wrote {len(rows)} rows to {args.json}")
    _print_table(bk.table_rows(rows), bk.TABLE_HEADERS)


def cmd_demo(args):
    from hisparse_jax.demo import run_demo
    run_demo(context=args.context, log=_log)


def build_parser():
    from hisparse_jax.config import PRESETS
    p = argparse.ArgumentParser(prog="hisparse", description="HiSparse KV cache tools")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="128K-token synthetic context: HiSparse vs dense")
    d.add_argument("--context", type=int, default=131072)
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("eval", help="quality on attention captured from your model")
    e.add_argument("--qkv", required=True, help="npz with q [N,Hq,D], k [S,Hkv,D], v [S,Hkv,D]")
    e.add_argument("--preset", default="default", choices=sorted(PRESETS))
    e.add_argument("--budget-tokens", type=_budget, default=None,
                   help="cold tokens attended per KV head, or 'all'")
    e.add_argument("--tail-sample-pages", type=int, default=None, metavar="N",
                   help="pages sampled to estimate the unselected mass (default: the "
                        "preset's, 32; 0 = selection only)")
    e.add_argument("--rerank-multiple", type=float, default=None, metavar="X",
                   help="candidate pages per budget page, re-ranked by their int4 keys "
                        "(default: the preset's, 1.25; 1 = no re-rank)")
    e.add_argument("--heads", type=_int_list(0), default=None, metavar="I,J,...",
                   help="report over these query heads only (e.g. your retrieval heads)")
    e.add_argument("--oracle-budgets", type=_int_list(1), default=None, metavar="N,M,...",
                   help="also report the oracle's recall with N, M, ... cold tokens per "
                        "KV head: the budget this attention needs, whatever the selection")
    e.add_argument("--implementation", choices=("auto", "xla", "pallas"), default="auto",
                   help="kernels: auto = Pallas on a GPU when they take the shapes, else XLA")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    a = bsub.add_parser("attention", help="sparse vs dense decode attention (XLA path)")
    a.add_argument("--context", type=int, default=131072)
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--repeats", type=int, default=7)
    a.add_argument("--preset", default="default", choices=sorted(PRESETS))
    a.add_argument("--tail-sample-pages", type=int, default=None, metavar="N",
                   help="pages sampled to estimate the unselected mass (default: the "
                        "preset's, 32; 0 = selection only)")
    a.add_argument("--rerank-multiple", type=float, default=None, metavar="X",
                   help="candidate pages per budget page, re-ranked by their int4 keys "
                        "(default: the preset's, 1.25; 1 = no re-rank)")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_bench_attention)
    kn = bsub.add_parser("kernels", help="Pallas kernels vs XLA references: time, bytes/s, "
                         "error (docs/kernels.md)")
    kn.add_argument("--case", default="ci",
                    help="ci, decode_{32k,128k,1m}_b{1,8}, a comma-separated list, or all")
    kn.add_argument("--impl", default="pallas,xla", help="pallas, xla or pallas,xla")
    kn.add_argument("--ops", default="lookup,sparse_decode,step,dense",
                    help="subset of lookup,sparse_decode,step,dense")
    kn.add_argument("--iters", type=int, default=None, help="timed calls per row (median)")
    kn.add_argument("--warmup", type=int, default=None, help="untimed calls after compile")
    kn.add_argument("--json", metavar="FILE", default=None,
                    help="write JSON lines to FILE ('-' = stdout, no table)")
    kn.set_defaults(func=cmd_bench_kernels)

    from hisparse_jax.capacity import add_capacity_parser
    from hisparse_jax.scheduler import add_scheduler_bench_parser
    add_scheduler_bench_parser(bsub)
    add_capacity_parser(sub)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = " ".join(["hisparse", *argv])
    if getattr(args, "context", 1) is not None and getattr(args, "context", 1) < 1:
        raise SystemExit("error: --context must be >= 1")
    if (getattr(args, "tail_sample_pages", None) or 0) < 0:
        raise SystemExit("error: --tail-sample-pages must be >= 0")
    rerank = getattr(args, "rerank_multiple", None)
    if rerank is not None and not (math.isfinite(rerank) and rerank >= 1):
        raise SystemExit("error: --rerank-multiple must be a finite number >= 1")
    sticky = getattr(args, "sticky_nats", None)
    if sticky is not None and not (math.isfinite(sticky) and sticky >= 0):
        raise SystemExit("error: --sticky-nats must be a finite number >= 0")
    args.func(args)


if __name__ == "__main__":
    main()
