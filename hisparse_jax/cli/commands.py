"""The commands of `hisparse` that are not a subsystem's own: eval, bench
attention, bench kernels, demo. Each raises `CLIError` (or ValueError) for a
user error; `hisparse_jax.cli.main` turns it into one line and exit code 2."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import zipfile

import numpy as np

from hisparse_jax.cli.args import CLIError, refuse_interpreted_pallas


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def load_qkv(path: str):
    """q [N, Hq, D], k/v [S, Hkv, D] from an npz; float16 or float32."""
    if not os.path.exists(path):
        raise CLIError(f"--qkv {path}: cannot read: no such file")
    if not os.path.isfile(path):
        raise CLIError(f"--qkv {path}: cannot read: not a regular file")
    if not zipfile.is_zipfile(path):  # np.load would talk of pickles
        raise CLIError(f"--qkv {path}: not an .npz file (a numpy zip archive, np.savez)")
    try:
        data = np.load(path, allow_pickle=False)
        arrays = {name: data[name] for name in ("q", "k", "v") if name in data.files}
    except ValueError as e:
        if "allow_pickle" in str(e):  # never loaded: unpickling runs arbitrary code
            raise CLIError(f"--qkv {path}: holds object (pickled) arrays; q, k and v must be "
                           "numeric arrays")
        raise CLIError(f"--qkv {path}: cannot read: {e}")
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise CLIError(f"--qkv {path}: cannot read: {e}")
    missing = {"q", "k", "v"} - set(arrays)
    if missing:
        raise CLIError(f"--qkv {path} lacks arrays {sorted(missing)} (needs q, k, v)")
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (np.float16, np.float32):
            raise CLIError(f"--qkv: {name} must be float16 or float32, got {x.dtype}")
        if x.ndim != 3:
            raise CLIError(f"--qkv: {name} must be 3-D, got shape {x.shape}")
        if 0 in x.shape:
            raise CLIError(f"--qkv: {name} has an empty dimension: shape {x.shape}")
    if k.shape != v.shape:
        raise CLIError(f"--qkv: k {k.shape} and v {v.shape} must match")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise CLIError(f"--qkv: q {q.shape} must be [N, Hq, D] with Hq a multiple of "
                       f"k's {k.shape[1]} heads and D = {k.shape[2]}")
    if not (np.all(np.isfinite(q)) and np.all(np.isfinite(k)) and np.all(np.isfinite(v))):
        raise CLIError("--qkv: q, k and v must be finite")
    return q, k, v


def _print_table(rows, headers):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def _eval_config(args):
    """The preset with the flags' overrides; a value the config refuses names its flag."""
    from hisparse_jax.config import preset
    cfg = preset(args.preset)
    for flag, field in (("--budget-tokens", "budget_tokens"),
                        ("--tail-sample-pages", "tail_sample_pages"),
                        ("--rerank-multiple", "rerank_multiple")):
        value = getattr(args, field)
        if value is None:
            continue
        try:
            cfg = cfg.replace(**{field: value})
        except ValueError as e:  # in the flag's words: -1 is what 'all' parses to
            why = str(e).split(': ', 1)[-1].replace("FULL_BUDGET (-1)", "'all'")
            raise CLIError(f"{flag} {value}: {why}")
    return cfg


def cmd_eval(args):
    from hisparse_jax.backends import resolve_implementation
    from hisparse_jax.harness.evaluation import config_for, evaluate
    cfg = _eval_config(args)
    for b in args.oracle_budgets or ():
        if b % cfg.page_size:
            raise CLIError(f"--oracle-budgets {b}: must be a multiple of the page size "
                           f"{cfg.page_size} (the oracle keeps whole pages)")
    q, k, v = load_qkv(args.qkv)
    if args.heads is not None and max(args.heads) >= q.shape[1]:
        raise CLIError(f"--heads {max(args.heads)} is not a query head (q has {q.shape[1]})")
    _log(f"evaluating {q.shape[0]} queries over {k.shape[0]} tokens ...")
    implementation = None if args.implementation == "auto" else args.implementation
    # the kernels as they will run on this capture's shapes (a head_dim Pallas cannot
    # hold is named here, before anything runs)
    kernels = resolve_implementation(implementation, config_for(cfg, k, q.shape[1] // k.shape[1]))
    refuse_interpreted_pallas([kernels])
    ev = evaluate(cfg, q, k, v, implementation=implementation, log=_log)
    summary = ev.summary(args.heads, args.oracle_budgets or ())
    bad = [key for key, val in _flat(summary) if not math.isfinite(val)]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CLIError(f"--qkv {args.qkv}: the metrics {', '.join(bad[:3])}{more} are not "
                       "finite: the logits q.k/sqrt(D) overflow float32 (scale q and k down)")
    if args.json:  # with what produced it: `auto` resolves per host
        run = {"command": args.command_line, "preset": args.preset,
               "budget_tokens": cfg.budget_tokens, "tail_sample_pages": cfg.tail_sample_pages,
               "rerank_multiple": cfg.rerank_multiple,
               "implementation": kernels}
        print(json.dumps({**summary, "run": run}, allow_nan=False))
        return
    rows = [(key, f"{val:.4f}") for key, val in summary.items() if not isinstance(val, dict)]
    rows += [(f"oracle_recall at {b} tokens", f"{val:.4f}")
             for b, val in summary.get("oracle_recall_at_budget", {}).items()]
    _print_table(rows, ("metric", "value"))


def _flat(d: dict, prefix=""):
    for key, val in d.items():
        if isinstance(val, dict):
            yield from _flat(val, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", float(val)


def cmd_bench_attention(args):
    from hisparse_jax.harness.attention_bench import bench_attention
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
    from hisparse_jax.harness import kernel_bench as bk
    plan = bk.plan(args.case, args.impl, args.ops, iters=args.iters, warmup=args.warmup)
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
            raise CLIError(f"--json {args.json}: cannot write: {e}")
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


# The real-model demo's flags and defaults (cli.build_parser's), which --synthetic refuses
DEMO_DEFAULTS = {"model": "smollm2-135m", "tokens": 7000, "depth": 0.5, "key": None,
                 "budget_tokens": None}


def cmd_demo(args):
    if args.synthetic:
        real = [f for f in ("model", "tokens", "depth", "key", "budget_tokens")
                if getattr(args, f) != DEMO_DEFAULTS[f]]
        if real:
            raise CLIError(f"--{real[0].replace('_', '-')} is the real-model demo's; "
                           "--synthetic takes --context N")
        from hisparse_jax.harness.synthetic_demo import run_demo
        return run_demo(context=args.context or 131072, log=_log)
    if args.context is not None:
        raise CLIError("--context is for --synthetic; the real-model demo takes --tokens N")
    if args.key is not None and args.key > 99999:
        raise CLIError(f"--key {args.key}: a 5-digit number (10000-99999)")
    if args.budget_tokens is not None and args.budget_tokens % 16 and args.budget_tokens != -1:
        raise CLIError(f"--budget-tokens {args.budget_tokens}: a multiple of 16 (the page "
                       "size) or 'all'")
    from hisparse_jax.harness.passkey_demo import run_demo
    run_demo(args.model, args.tokens, args.depth, args.key, args.budget_tokens, log=_log)
