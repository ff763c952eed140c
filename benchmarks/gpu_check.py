"""One script for the H200: check every Pallas kernel against its reference on
the device, then time HiSparse sparse decode (Pallas and XLA) against a dense
bf16 decode baseline. Writes one JSON row per check / timed case.

    python benchmarks/gpu_check.py                 # on the GPU machine
    python benchmarks/gpu_check.py --dry-run       # CPU, tiny shapes, interpret mode (< 1 min)

Inputs are synthetic arrays of the right shapes and dtypes (random codes,
random digests (centre, radius >= 0), random page tables); nothing here builds a
HiSparse cache, so it does not depend on the cache code.

Timed implementations per case (Llama-3-8B heads: 32 q heads, 8 kv heads, D 128):
  dense_bf16     hisparse_jax.attention.dense_decode_attention on bf16 K/V of the
                 whole context (the baseline: reads every K/V byte);
  sparse_xla     page scores + top-k selection + sparse decode, pure-jnp references;
  sparse_pallas  the same step with the Pallas kernels;
  lookup_pallas, decode_pallas   the two Pallas kernels alone;
  select_xla     the selection between them alone (top-k of the bound, tail
                 sample; bytes = its inputs): on the H200 the step minus both
                 kernels was 0.44-0.56 ms, most of the step at 32K-128K.
Each: one compile call (timed apart), warm-up, then the median of N calls each
ending in block_until_ready. bytes = bytes the step must read from HBM (model
below); bytes/s is compared with the ~4.3e12 B/s copy ceiling of the H200.

Then the model steps (`--model-steps`, each a `hisparse` subprocess with its own
time limit, its rows appended to the same file):
  bench_generate  `hisparse bench generate --model llama3-8b-shapes` at 32K and
                  128K tokens, HiSparse against dense (issue 14's device step);
  bench_serve     `hisparse serve --model llama3-8b-shapes --max-context 131072
                  --offload` loaded by `hisparse bench serve` (16-20K-token prompts
                  by default), and the server's offload counters (issue 15's).
--dry-run runs the same steps on smollm2-135m at small sizes.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.harness.kernel_bench import (  # shared with `hisparse bench kernels`
    DECODE_ARGS,
    PEAK_BYTES_PER_S,
    make_case,
    make_ops,
    op_bytes,
    rel_err,
    select_with_sample,
    time_fn,
)
from pallas_kernels.lookup import kernel as lookup_kernel
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.quant import kernel as quant_kernel
from pallas_kernels.quant import reference as quant_ref
from pallas_kernels.sparse_decode import kernel as decode_kernel
from pallas_kernels.sparse_decode import reference as decode_ref

# ----------------------------------------------------------------------------- shapes


def shape_set(dry_run: bool):
    if dry_run:
        return {"contexts": [512], "batches": [1, 2], "kv_heads": 2, "group": 4, "head_dim": 64,
                    "page": 16, "sink": 16, "hot": 16, "warm": 32, "budget": 64, "value_group": 32}
    # Llama-3-8B heads; HiSparse default tiers (sink 16, hot 128, warm 384, budget 2048).
    return {"contexts": [32768, 131072, 1048576], "batches": [1, 8], "kv_heads": 8, "group": 4,
                "head_dim": 128, "page": 16, "sink": 16, "hot": 128, "warm": 384, "budget": 2048,
                "value_group": 32}


# Inputs (make_case) and the byte model (op_bytes) live in hisparse_jax.harness.kernel_bench.
_IMPL_OPS = {"dense_bf16": "dense", "sparse_xla": "step", "sparse_pallas": "step",
             "lookup_pallas": "lookup", "decode_pallas": "sparse_decode"}


def bytes_model(dims, impl):
    """HBM bytes a decode step must read (K/V/codes/scales/digests/tables + q)."""
    return op_bytes(dims, _IMPL_OPS[impl])


# ----------------------------------------------------------------------------- steps


def make_steps(dims, interpret):
    """The timed functions, by name (see the module docstring)."""
    xla = make_ops(dims, "xla", interpret)
    pallas = make_ops(dims, "pallas", interpret)
    return {"dense_bf16": xla["dense"],
            "sparse_xla": jax.jit(lambda a: xla["step"](a)[0]),
            "sparse_pallas": jax.jit(lambda a: pallas["step"](a)[0]),
            "lookup_pallas": pallas["lookup"],
            "decode_pallas": pallas["sparse_decode"],
            # the step's middle alone: top-k of the bound, the tail sample
            "select_xla": jax.jit(lambda a: select_with_sample(
                a["bound"], a["center"], a["page_table"], dims["cold_pages"],
                dims["sample_pages"])[0])}


# ----------------------------------------------------------------------------- checks


def checks(interpret, dry_run):
    """Each kernel vs its reference on this backend: JSON rows, one by one."""
    key = jax.random.PRNGKey(0)
    d, h, g, page, b = (64, 2, 4, 16, 2) if dry_run else (128, 8, 4, 16, 2)
    arrays, dims = make_case(key, batch=b, context=2048 if dry_run else 8192, kv_heads=h,
                             group=g, head_dim=d, page=page, sink=16, hot=16 if dry_run else 128,
                             warm=32 if dry_run else 384, budget=256, value_group=32,
                             with_dense=False)
    # lookup
    args = (arrays["q"], arrays["digest_center"], arrays["digest_radius"],
            arrays["page_table"])
    got = lookup_kernel.page_scores(*args, interpret=interpret)
    # References in full f32: XLA's default on a GPU rounds f32 dots to TF32 (about
    # 1e-4 of the output on the H200, 2026-12-04), the kernels do not.
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lookup_ref.page_scores)(*args)
    err = max(rel_err(x, y) for x, y in zip(got, ref))
    # Which side is off, and in which output: both against the same scores in
    # float64 on the host (the first H200 run had kernel vs reference at 9.4e-4).
    truth = _lookup_f64(*args)
    yield {"kind": "diagnostic", "kernel": "lookup.page_scores_vs_f64",
           **{f"{side}_{name}_rel_err": rel_err(x, t)
              for side, out in (("kernel", got), ("reference", ref))
              for name, x, t in zip(("bound", "center"), out, truth)}}
    yield ({"kind": "check", "kernel": "lookup.page_scores", "max_rel_err": err,
                     "ok": bool(err < 1e-4 and all(_same_inf(x, y) for x, y in zip(got, ref)))})
    # sparse decode, with NaN in masked slots and unused pool page 0
    bound, center = ref
    cold, logw = select_with_sample(bound, center, arrays["page_table"], dims["cold_pages"],
                                    dims["sample_pages"])
    cold = cold.at[:, :, -2:].set(-1)
    cold = jnp.where(cold == 0, -1, cold)  # pool page 0 is poisoned below: only -1 reaches it
    a = dict(arrays)
    a["bf16_valid"] = a["bf16_valid"].at[:, 1::3].set(False)
    a["bf16_k"] = jnp.where(a["bf16_valid"][:, None, :, None], a["bf16_k"], jnp.nan)
    a["int4_v_scale"] = a["int4_v_scale"].at[:, 0].set(jnp.nan)
    a["digest_center"] = a["digest_center"].at[:, 0].set(jnp.nan)
    a["digest_radius"] = a["digest_radius"].at[:, 0].set(jnp.nan)
    dargs = [a[n] for n in DECODE_ARGS] + [cold]
    for prec in ("bf16x3", "f32", "bf16"):
        cfg = decode_kernel.DecodeConfig(precision=prec)
        o, lse = decode_kernel.sparse_decode(*dargs, sm_scale=1 / math.sqrt(d), cold_logw=logw,
                                             interpret=interpret, config=cfg)
        with jax.default_matmul_precision("highest"):
            ro, rlse = jax.jit(lambda *x: decode_ref.sparse_decode(
                *x, sm_scale=1 / math.sqrt(d), cold_logw=logw))(*dargs)
        tol = {"bf16x3": 1e-4, "f32": 1e-4, "bf16": 3e-2}[prec]
        err = max(rel_err(o, ro), rel_err(lse, rlse))
        o, ro, lse, rlse = (np.asarray(x, np.float32) for x in (o, ro, lse, rlse))
        both = np.isfinite(o) & np.isfinite(ro)
        yield ({"kind": "check", "kernel": f"sparse_decode[{prec}]", "max_rel_err": err,
                "finite": bool(np.isfinite(o).all()),
                # where the error comes from, if any: non-finite entries, or values
                "nonfinite_out": int((~np.isfinite(o)).sum()),
                "nonfinite_ref": int((~np.isfinite(ro)).sum()),
                "nonfinite_lse": int((~np.isfinite(lse)).sum()),
                "nonfinite_lse_ref": int((~np.isfinite(rlse)).sum()),
                "max_abs_diff_finite": float(np.abs(o - ro)[both].max(initial=0.0)),
                "max_abs_ref": float(np.abs(ro)[np.isfinite(ro)].max(initial=0.0)),
                "ok": bool(err < tol and np.isfinite(o).all())})
    # encoders, bit exact
    x = jax.random.normal(jax.random.PRNGKey(1), (64, h, page, d), jnp.float32) * 3
    for name, f, fr in (
            ("quant.encode_fp8", lambda v: quant_kernel.encode_fp8(v, interpret=interpret),
             quant_ref.encode_fp8),
            ("quant.encode_cold_keys",
             lambda v: quant_kernel.encode_cold_keys(v, interpret=interpret),
             quant_ref.encode_cold_keys),
            ("quant.encode_cold_values",
             lambda v: quant_kernel.encode_cold_values(v, 32, interpret=interpret),
             lambda v: quant_ref.encode_cold_values(v, 32))):
        got, ref = f(x), jax.jit(fr)(x)
        mism = sum(int(np.sum(_bits(u) != _bits(r))) for u, r in zip(got, ref))
        # how far apart: 1-ulp rounding (approximate division) or garbage
        diff = max(float(np.nanmax(np.abs(np.asarray(u, np.float32) - np.asarray(r, np.float32)),
                                   initial=0.0)) for u, r in zip(got, ref))
        yield ({"kind": "check", "kernel": name, "mismatches": mism,
                "size": sum(int(np.size(r)) for r in ref), "max_abs_diff": diff,
                "ok": mism == 0})
    yield offload_check(interpret)


def _lookup_f64(q, center, radius, table):
    """lookup_ref.page_scores' formula in numpy float64 (q scaled and rounded to
    bf16 as there; exact products and sums): (bound [B,Hkv,G,N], center [B,Hkv,N])."""
    d = q.shape[-1]
    qs = (q.astype(jnp.float32) * (1.0 / math.sqrt(d))).astype(jnp.bfloat16)
    qs, qa = np.asarray(qs, np.float64), np.abs(np.asarray(qs, np.float64))
    c = np.asarray(center.astype(jnp.float32), np.float64)        # [Hkv, P, D]
    r = np.asarray(radius.astype(jnp.float32), np.float64)
    t = np.asarray(table)
    ok = t >= 0
    ids = np.maximum(t, 0)
    heads = np.arange(c.shape[0])[None, :, None]
    cp, rp = c[heads, ids[:, None, :]], r[heads, ids[:, None, :]]   # [B, Hkv, N, D]
    with np.errstate(invalid="ignore", over="ignore"):
        cen = np.einsum("bhgd,bhnd->bhgn", qs, cp)
        bound = cen + np.einsum("bhgd,bhnd->bhgn", qa, rp)
        bound = np.where(ok[:, None, None, :], bound, -np.inf)
        x = np.where(ok[:, None, None, :], cen, -np.inf)
        m = x.max(axis=3, keepdims=True)
        x = x - (m + np.log(np.exp(x - m).sum(axis=3, keepdims=True)))
        m = x.max(axis=2, keepdims=True)
        mass = (m + np.log(np.exp(x - m).sum(axis=2, keepdims=True)))[:, :, 0]
        mass = np.where(ok[:, None, :], mass, -np.inf)
    return bound, mass


def offload_check(interpret):
    """The offload path on this backend: host pool in pinned_host memory, host-side
    gather/scatter, copies to the device; outputs must equal the all-resident
    cache's bit for bit over a few decode steps with appends."""
    from hisparse_jax.cache.handle import HiSparseCache
    from hisparse_jax.config import HiSparseConfig
    from hisparse_jax.offload.store import OffloadedCache
    impl = "xla" if interpret else "pallas"
    cfg = HiSparseConfig(num_kv_heads=2, head_dim=64, max_context=4096, max_seqs=2,
                         budget_tokens=256)
    rng = np.random.default_rng(0)
    kv = rng.normal(size=(2, 2, 3000, 2, 64)).astype(np.float32)
    caches = [HiSparseCache(cfg, implementation=impl) for _ in range(2)]
    for c in caches:
        for b in range(2):
            c.prefill(b, kv[0, b], kv[1, b])
    off = OffloadedCache(caches[1])
    same = True
    for _ in range(8):
        k, v = (rng.normal(size=(2, 2, 64)).astype(np.float32) for _ in "kv")
        caches[0].append(k, v)
        off.append(k, v)
        q = rng.normal(size=(2, cfg.num_q_heads, 64)).astype(np.float32)
        same &= bool(np.array_equal(np.asarray(off.attend(q)), np.asarray(caches[0].attend(q))))
    c = off.counters()
    return {"kind": "check", "kernel": "offload", "implementation": impl,
            "host_memory_kind": off.memory_kind, "hit_rate": c["hit_rate"],
            "host_to_device_bytes": c["host_to_device_bytes_copied"], "ok": same}


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.astype(np.float32).view(np.uint32)


def _same_inf(x, y):
    return bool(np.array_equal(np.isneginf(np.asarray(x)), np.isneginf(np.asarray(y))))


# ----------------------------------------------------------------------------- model steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HISPARSE = [sys.executable, "-m", "hisparse_jax.cli"]


def model_step_plan(dry_run: bool) -> dict:
    if dry_run:
        return {"model": "smollm2-135m", "steps": [("generate", "512", "1,2"), ("serve",)],
                "serve_context": 1024,
                "serve_seqs": 2, "prompt_len": "600", "output_len": "8", "prompts": 2,
                "serve_budget": 64, "limit_s": 300}
    # Sized by the first H200 run (2026-12-04): prefill ran at ~3.5K tok/s at 32K and
    # ~1.2K at 128K (so one 128K engine needs ~2 min), and the offloaded server
    # finished one 19K-token request in ~2 min; 100K+ prompts did not fit. Batch 8
    # at 128K would need 128 GiB of bf16 K/V for dense: HiSparse alone there.
    return {"model": "llama3-8b-shapes",
            "steps": [("generate", "32768", "1"), ("serve",),
                      ("generate", "131072", "1", "hisparse"),
                      ("generate", "131072", "1", "dense"), ("generate", "32768", "8"),
                      ("generate", "131072", "8", "hisparse")],
            "serve_context": 131072, "serve_seqs": 2, "prompt_len": "16000:20000",
            # a 16th of the prompts: serve's default at 128K is 2,048 (its cap), a
            # 9th of a 19K prompt; the first run copied 65 MB a step with it
            "serve_budget": 1024, "output_len": "32", "prompts": 2, "limit_s": 240}


def _run_logged(cmd, log_path, timeout, env=None):
    """Runs cmd with stdout+stderr appended to log_path; -> (rc or 'timeout', stdout)."""
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        try:
            p = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                               timeout=timeout, env=env)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            log.write(out)
            return "timeout", out
        log.write(p.stdout)
        return p.returncode, p.stdout


def model_steps(dry_run: bool, out_dir: str, emit, deadline: float, **override):
    """Issue 14's and 15's device steps (module docstring); each row names its
    command, and a step that fails or runs out of time says so in its row.
    override: plan entries to replace (`main`'s --steps, --serve-prompt-len, ...)."""
    plan = {**model_step_plan(dry_run), **{k: v for k, v in override.items() if v is not None}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1",  # `python -m hisparse_jax.cli` from anywhere
           "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    log = os.path.join(out_dir, "model_steps.log")
    for step, *what in plan["steps"]:
        if step == "serve":
            serve_step(plan, out_dir, emit, deadline, env, log)
        else:
            generate_step(plan, *what, emit=emit, deadline=deadline, env=env, log=log)


def generate_step(plan, context, batch, *engines, emit, deadline, env, log):
    """One `hisparse bench generate` run: its rows, or one saying why there are none."""
    cmd = HISPARSE + ["bench", "generate", "--model", plan["model"], "--context", context,
                      "--batch", batch, "--engines", ",".join(engines or ["hisparse",
                                                                           "dense"]),
                      "--decode", "32", "--json"]
    if plan.get("implementation"):
        cmd += ["--implementation", plan["implementation"]]
    left = deadline - time.time()
    if left < 30:
        emit({"kind": "bench_generate", "step_command": shlex.join(cmd), "skipped": "time"})
        return
    rc, out = _run_logged(cmd, log, min(left, plan["limit_s"]), env)
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    for r in rows:
        emit({"kind": "bench_generate", **r})
    if rc != 0:
        emit({"kind": "bench_generate", "step_command": shlex.join(cmd), "rc": rc,
              "rows": len(rows), "error": "see model_steps.log"})


def serve_step(plan, out_dir, emit, deadline, env, log):
    """`hisparse serve --offload` on a free loopback port, loaded by `hisparse bench
    serve`; one row: the bench's figures and the server's offload counters."""
    left = deadline - time.time()
    if left < 60:
        emit({"kind": "bench_serve", "skipped": "time"})
        return
    # the server helpers of the CPU side-by-side benchmark (loopback, free port, PID)
    from serve_side_by_side import free_port, start, stop, wait_up
    port = free_port()
    serve_cmd = HISPARSE + ["serve", "--model", plan["model"], "--max-context",
                            str(plan["serve_context"]), "--max-seqs", str(plan["serve_seqs"]),
                            "--offload", "--prefill-budget", "4096", "--port", str(port)]
    if plan.get("implementation"):
        serve_cmd += ["--implementation", plan["implementation"]]
    if plan.get("serve_budget"):
        serve_cmd += ["--budget-tokens", str(plan["serve_budget"])]
    t0 = time.time()
    server = start(serve_cmd, env=env, log=os.path.join(out_dir, "serve.log"))
    base = f"http://127.0.0.1:{port}"
    row = {"kind": "bench_serve", "serve_command": shlex.join(serve_cmd)}
    try:
        wait_up(base, server, timeout=max(1, deadline - 30 - time.time()))
        row["server_ready_s"] = round(time.time() - t0, 1)
        result = os.path.join(out_dir, "bench_serve.json")
        cmd = HISPARSE + ["bench", "serve", "--base-url", base, "--tokenizer", "none",
                          "--dataset", "random", "--input-len", plan["prompt_len"],
                          "--output-len", plan["output_len"], "--num-prompts",
                          str(plan["prompts"]), "--max-concurrency", str(plan["serve_seqs"]),
                          "--warmup", "1", "--ignore-eos", "--no-progress", "--json", result]
        # the client needs no accelerator (and must not take the GPU's memory)
        rc, _ = _run_logged(cmd, log, max(1, deadline - time.time() - 15),
                            {**env, "JAX_PLATFORMS": "cpu"})
        if os.path.exists(result):
            with open(result) as f:
                for x in f:
                    if x.strip():
                        row.update(json.loads(x))
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        with open(os.path.join(out_dir, "metrics.txt"), "w") as f:
            f.write(metrics)
        # the latency histograms' sums and counts too: with no finished bench
        # request they still say where the warm-up's time went
        row["server_metrics"] = {
            ln.split()[0]: float(ln.split()[-1]) for ln in metrics.splitlines()
            if ln.startswith(("hisparse:offload", "hisparse:cold_pages_read",
                              "hisparse:generation_tokens_total",
                              "hisparse:prompt_tokens_total", "hisparse:request_success",
                              "hisparse:time_to_first_token_seconds_",
                              "hisparse:inter_token_latency_seconds_",
                              "hisparse:e2e_request_latency_seconds_"))
            and "_bucket" not in ln}
        emit({**row, "rc": rc})
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- the row says what broke
        emit({**row, "error": repr(e)[:2000]})
    finally:
        # the server alone (SIGTERM, SIGKILL after 120 s): a signal to its group
        # would also stop a compile in flight, which it then logs as a failure
        stop(server)


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny shapes, interpret mode; checks the script itself")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--contexts", type=int, nargs="*", default=None)
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--impls", nargs="*", default=None,
                    help="subset of dense_bf16 sparse_xla sparse_pallas lookup_pallas "
                         "decode_pallas select_xla")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true", help="no kernel timing")
    ap.add_argument("--model-steps", action="store_true",
                    help="then the model steps (bench generate, serve + bench serve)")
    ap.add_argument("--steps", nargs="+", default=None, metavar="STEP",
                    help="model steps instead of the default plan: serve, or "
                         "generate:CONTEXTS:BATCHES[:ENGINES] (e.g. generate:32768:1,8)")
    ap.add_argument("--implementation", choices=("pallas", "xla"), default=None,
                    help="HiSparse's kernels in the model steps (default: Pallas on a GPU)")
    ap.add_argument("--serve-prompt-len", default=None, metavar="N|A:B")
    ap.add_argument("--serve-prompts", type=int, default=None, metavar="N")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="wall-clock limit for the whole script; steps past it are skipped")
    ap.add_argument("--out", default=None, help="JSON-lines file (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    deadline = time.time() + args.budget_s
    now = _dt.datetime.now(_dt.UTC)
    out_path = os.path.abspath(args.out or os.path.join(
        ROOT, "benchmarks", "results",
        f"gpu_check-{now:%Y%m%dT%H%M%SZ}{'-dry' if args.dry_run else ''}.jsonl"))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    if args.model_steps:
        # The kernel part in a process of its own: JAX keeps most of the GPU's memory
        # until its process exits, and the model steps need it.
        if not (args.skip_checks and args.skip_kernels):
            argv = sys.argv[1:] if argv is None else list(argv)
            child = [sys.executable, os.path.abspath(__file__),
                     *[a for a in argv if a != "--model-steps"], "--out", out_path,
                     "--budget-s", str(round(args.budget_s * 0.3))]
            try:
                subprocess.run(child, cwd=ROOT, check=False, timeout=args.budget_s * 0.35)
            except subprocess.TimeoutExpired:
                print("gpu_check: the kernel part ran out of time", file=sys.stderr)
        common = {"date": now.isoformat(timespec="seconds"), "commit": _commit(),
                  "host": platform.node(), "dry_run": args.dry_run}
        n = 0

        def emit_step(row):
            nonlocal n
            n += 1
            _emit(out_path, {**common, **row})

        steps = None if args.steps is None else [tuple(x.split(":")) for x in args.steps]
        model_steps(args.dry_run, os.path.dirname(out_path), emit_step, deadline,
                    steps=steps, implementation=args.implementation,
                    prompt_len=args.serve_prompt_len, prompts=args.serve_prompts)
        print(f"wrote {n} model-step rows to {out_path}")
        return 0

    backend = jax.default_backend()
    interpret = True if args.dry_run else backend != "gpu"
    if not args.dry_run and backend != "gpu":
        print(f"warning: backend is {backend!r}, not gpu: Pallas runs in interpret mode",
              file=sys.stderr)
    shapes = shape_set(args.dry_run)
    contexts = args.contexts or shapes.pop("contexts")
    shapes.pop("contexts", None)
    batches = args.batches or shapes.pop("batches")
    shapes.pop("batches", None)
    iters = args.iters or (2 if args.dry_run else 20)
    warmup = 1 if args.dry_run else args.warmup
    impls = args.impls or ["dense_bf16", "sparse_xla", "sparse_pallas", "lookup_pallas",
                           "decode_pallas", "select_xla"]
    common = {"date": now.isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
              "commit": _commit(), "backend": backend,
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "host": platform.node(), "dry_run": args.dry_run, "interpret": interpret}
    rows = []

    def emit(row):
        row = {**common, **row}
        rows.append(row)
        _emit(out_path, row)

    if not args.skip_checks:
        try:
            for row in checks(interpret, args.dry_run):
                emit(row)
        except Exception as e:  # noqa: BLE001 -- the row says which check broke
            emit({"kind": "check", "kernel": "(next after the rows above)", "ok": False,
                  "error": repr(e)[:2000]})

    for context in [] if args.skip_kernels else contexts:
        for batch in batches:
            if time.time() > deadline:
                emit({"kind": "time", "context": context, "batch": batch, "skipped": "time"})
                continue
            key = jax.random.PRNGKey(context + batch)
            arrays, dims = make_case(key, batch=batch, context=context,
                                     with_dense="dense_bf16" in impls, **shapes)
            steps = make_steps(dims, interpret)
            outs = {}
            if {"decode_pallas", "select_xla"} & set(impls):  # their inputs, made once
                bound, center = lookup_ref.page_scores(
                    arrays["q"], arrays["digest_center"], arrays["digest_radius"],
                    arrays["page_table"])
                ids, logw = select_with_sample(bound, center, arrays["page_table"],
                                               dims["cold_pages"], dims["sample_pages"])
                selected = dict(arrays, cold_ids=ids, cold_logw=logw, bound=bound,
                                center=center)
            for impl in impls:
                a = selected if impl in ("decode_pallas", "select_xla") else arrays
                try:
                    out, t = time_fn(steps[impl], a, iters, warmup)
                except Exception as e:  # noqa: BLE001 -- one failing case must not hide the rest
                    emit(dict(kind="time", impl=impl, **dims, error=repr(e)[:2000]))
                    continue
                outs[impl] = out
                nbytes = (sum(a[n].nbytes for n in ("bound", "center", "page_table"))
                          if impl == "select_xla" else bytes_model(dims, impl))
                row = dict(kind="time", impl=impl, **dims, **t, bytes=nbytes,
                           bytes_per_s=nbytes / t["median_s"],
                           frac_of_peak=nbytes / t["median_s"] / PEAK_BYTES_PER_S)
                if impl == "sparse_pallas" and "sparse_xla" in outs:
                    row["max_abs_diff_vs_xla"] = float(
                        jnp.max(jnp.abs(out - outs["sparse_xla"])))
                emit(row)
            del arrays, steps, outs
            selected = None
    print(f"wrote {len(rows)} rows to {out_path}")
    bad = [r for r in rows if r.get("kind") == "check" and not r["ok"]]
    return 1 if bad else 0


def _emit(path, row):
    print(json.dumps({k: v for k, v in row.items() if k not in ("command", "host")}),
          flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False, cwd=ROOT).stdout.strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
