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
  lookup_pallas, decode_pallas   the two Pallas kernels alone.
Each: one compile call (timed apart), warm-up, then the median of N calls each
ending in block_until_ready. bytes = bytes the step must read from HBM (model
below); bytes/s is compared with the ~4.3e12 B/s copy ceiling of the H200.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lookup import kernel as lookup_kernel
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.quant import kernel as quant_kernel
from pallas_kernels.quant import reference as quant_ref
from pallas_kernels.sparse_decode import kernel as decode_kernel
from pallas_kernels.sparse_decode import reference as decode_ref

PEAK_BYTES_PER_S = 4.3e12  # measured copy ceiling of the H200
INT32_LIMIT = 2**31 - 1    # Pallas Triton pool offsets are int32


# ----------------------------------------------------------------------------- shapes


def shape_set(dry_run: bool):
    if dry_run:
        return {"contexts": [512], "batches": [1, 2], "kv_heads": 2, "group": 4, "head_dim": 64,
                    "page": 16, "sink": 16, "hot": 16, "warm": 32, "budget": 64, "value_group": 32}
    # Llama-3-8B heads; HiSparse default tiers (sink 16, hot 128, warm 384, budget 2048).
    return {"contexts": [32768, 131072, 1048576], "batches": [1, 8], "kv_heads": 8, "group": 4,
                "head_dim": 128, "page": 16, "sink": 16, "hot": 128, "warm": 384, "budget": 2048,
                "value_group": 32}


def make_case(key, *, batch, context, kv_heads, group, head_dim, page, sink, hot, warm, budget,
              value_group, with_dense=True):
    """Synthetic tiers for one decode step. Cold pool pages alias (page id modulo the
    pool size) when a full pool would pass int32 offsets; that changes no byte counts."""
    b, h, g, d = batch, kv_heads, group, head_dim
    ks = iter(jax.random.split(key, 24))
    tb, tw = sink + hot, warm
    n = context // page                         # logical pages per sequence
    k_sel = min(budget // page, n)
    per_page = h * page * (d // 2)
    pool = min(b * n, INT32_LIMIT // per_page)
    ng = d // value_group
    q = jax.random.normal(next(ks), (b, h, g, d), jnp.float32)
    arrays = {
        "q": q,
        "bf16_k": jax.random.normal(next(ks), (b, h, tb, d), jnp.bfloat16),
        "bf16_v": jax.random.normal(next(ks), (b, h, tb, d), jnp.bfloat16),
        "bf16_valid": jnp.ones((b, tb), bool),
        "fp8_k": jax.random.normal(next(ks), (b, h, tw, d), jnp.float32).astype(jnp.float8_e4m3fn),
        "fp8_v": jax.random.normal(next(ks), (b, h, tw, d), jnp.float32).astype(jnp.float8_e4m3fn),
        "fp8_k_scale": jax.random.uniform(next(ks), (b, h, tw), jnp.float32, 0.001, 0.01),
        "fp8_v_scale": jax.random.uniform(next(ks), (b, h, tw), jnp.float32, 0.001, 0.01),
        "fp8_valid": jnp.ones((b, tw), bool),
        # Cold pool, head-major [Hkv, P, ...] (hisparse_jax.state layout).
        "int4_k": jax.random.bits(next(ks), (h, pool, page, d // 2), jnp.uint8),
        "int4_v": jax.random.bits(next(ks), (h, pool, page, d // 2), jnp.uint8),
        "int4_v_scale": jax.random.uniform(next(ks), (h, pool, page, ng), jnp.float32,
                                        0.01, 0.2).astype(jnp.bfloat16),
        "int4_v_zero": jax.random.uniform(next(ks), (h, pool, page, ng), jnp.float32,
                                       -1.5, -0.5).astype(jnp.bfloat16),
    }
    # Digest: per-channel key range centre and radius (>= 0) of each page, [Hkv, P, D].
    arrays["digest_center"] = jax.random.normal(next(ks), (h, pool, d), jnp.bfloat16)
    arrays["digest_radius"] = jax.random.uniform(next(ks), (h, pool, d), jnp.float32,
                                                 0.0, 1.5).astype(jnp.bfloat16)
    # Sequence i owns logical pages i*n .. i*n+n-1 of the pool (aliased modulo pool);
    # the most recent pages (sink/hot/warm) are not candidates.
    table = (jnp.arange(b, dtype=jnp.int32)[:, None] * n + jnp.arange(n, dtype=jnp.int32)) % pool
    recent = -(-(tb + tw) // page)
    table = jnp.where(jnp.arange(n)[None, :] >= n - recent, -1, table) if n > recent else table
    arrays["page_table"] = table.astype(jnp.int32)
    dims = {"batch": b, "context": context, "kv_heads": h, "q_heads": h * g, "head_dim": d, "page": page,
                "bf16_tokens": tb, "fp8_tokens": tw, "cold_pages": k_sel, "pool_pages": pool,
                "pool_aliased": pool < b * n, "value_group": value_group}
    if with_dense:
        # Dense baseline K/V: tile a random block so no context-sized f32 temporary exists.
        blk = min(context, 4096)
        base_k = jax.random.normal(next(ks), (1, h, blk, d), jnp.bfloat16)
        base_v = jax.random.normal(next(ks), (1, h, blk, d), jnp.bfloat16)
        reps = (b, 1, context // blk, 1)
        arrays["dense_k"] = jnp.tile(base_k, reps)
        arrays["dense_v"] = jnp.tile(base_v, reps)
    return arrays, dims


def bytes_model(dims, impl):
    """HBM bytes a decode step must read (K/V/codes/scales/digests/tables + q)."""
    b, h, d, page = dims["batch"], dims["kv_heads"], dims["head_dim"], dims["page"]
    q_bytes = b * dims["q_heads"] * d * 4
    if impl == "dense_bf16":
        return q_bytes + b * h * dims["context"] * d * 2 * 2
    n = dims["context"] // page
    ng = d // dims["value_group"]
    lookup = b * n * 4 + b * h * n * d * 2 * 2            # page table + both digests
    bf16 = b * h * dims["bf16_tokens"] * d * 2 * 2 + b * dims["bf16_tokens"]
    fp8 = b * h * dims["fp8_tokens"] * (d * 2 + 8) + b * dims["fp8_tokens"]
    k = dims["cold_pages"]
    cold = b * h * k * (page * (d // 2) * 2 + page * ng * 2 * 2 + d * 2 * 2 + 4)
    if impl.startswith("lookup"):
        return q_bytes + lookup
    if impl.startswith("decode"):
        return q_bytes + bf16 + fp8 + cold
    return q_bytes + lookup + bf16 + fp8 + cold


# ----------------------------------------------------------------------------- steps


def select(bound, center, table, k, bound_share=0.25):
    """Cold pool pages to attend [B, Hkv, k] (like hisparse_jax.attention.select_pages):
    a `bound_share` of the budget by Quest's bound (per query head when the bound is
    [B, Hkv, G, N]), the rest by centre score among the pages not yet taken.
    Duplicate picks of several heads are kept (same cost, same result on both sides)."""
    if bound.ndim == 4:
        g = bound.shape[2]
        per_head = max(1, min(round(k * bound_share) // g, bound.shape[-1]))
        top_b, pages_b = jax.lax.top_k(bound, per_head)
        top_b = top_b.reshape(*top_b.shape[:2], -1)
        pages_b = pages_b.reshape(*pages_b.shape[:2], -1)
    else:
        top_b, pages_b = jax.lax.top_k(bound, max(1, round(k * bound_share)))
    bi = jnp.arange(center.shape[0])[:, None, None]
    hi = jnp.arange(center.shape[1])[None, :, None]
    center = center.at[bi, hi, pages_b].set(-jnp.inf)
    top_c, pages_c = jax.lax.top_k(center, max(k - pages_b.shape[-1], 0))
    top = jnp.concatenate([top_b, top_c], axis=-1)
    logical = jnp.concatenate([pages_b, pages_c], axis=-1)
    pool = jnp.take_along_axis(table[:, None, :], logical, axis=2)
    return jnp.where(top > -jnp.inf, pool, -1).astype(jnp.int32)


DECODE_ARGS = ("q", "bf16_k", "bf16_v", "bf16_valid", "fp8_k", "fp8_v", "fp8_k_scale",
               "fp8_v_scale", "fp8_valid", "int4_k", "int4_v", "int4_v_scale", "int4_v_zero",
               "digest_center", "digest_radius")


def make_steps(dims, interpret):
    d = dims["head_dim"]
    k = dims["cold_pages"]
    sm = 1.0 / math.sqrt(d)
    ops = {
        "xla": (lookup_ref.page_scores,
                lambda *a: decode_ref.sparse_decode(*a, sm_scale=sm)),
        "pallas": (lambda *a: lookup_kernel.page_scores(*a, interpret=interpret),
                   lambda *a: decode_kernel.sparse_decode(*a, sm_scale=sm, interpret=interpret)),
    }

    def sparse(impl):
        scores, decode = ops[impl]

        @jax.jit
        def step(a):
            bound, center = scores(a["q"], a["digest_center"], a["digest_radius"],
                                   a["page_table"])
            cold = select(bound, center, a["page_table"], k)
            out, _ = decode(*(a[n] for n in DECODE_ARGS), cold)
            return out
        return step

    @jax.jit
    def lookup_pallas(a):
        return ops["pallas"][0](a["q"], a["digest_center"], a["digest_radius"],
                                a["page_table"])

    @jax.jit
    def decode_pallas(a):
        return ops["pallas"][1](*(a[n] for n in DECODE_ARGS), a["cold_ids"])

    from hisparse_jax.attention import dense_decode_attention

    @jax.jit
    def dense(a):
        b = a["q"].shape[0]
        q = a["q"].reshape(b, -1, d)
        lengths = jnp.full((b,), a["dense_k"].shape[2], jnp.int32)
        return dense_decode_attention(q, a["dense_k"], a["dense_v"], lengths)

    return {"dense_bf16": dense, "sparse_xla": sparse("xla"), "sparse_pallas": sparse("pallas"),
            "lookup_pallas": lookup_pallas, "decode_pallas": decode_pallas}


def time_fn(fn, args, iters, warmup):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(args))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(args))
        ts.append(time.perf_counter() - t0)
    ts = np.asarray(ts)
    return out, {"compile_s": compile_s, "median_s": float(np.median(ts)),
                     "p10_s": float(np.percentile(ts, 10)), "p90_s": float(np.percentile(ts, 90)),
                     "iters": iters}


# ----------------------------------------------------------------------------- checks


def checks(interpret, dry_run):
    """Each kernel vs its reference on this backend. Returns JSON rows."""
    rows = []
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
    ref = jax.jit(lookup_ref.page_scores)(*args)
    err = max(_rel_err(x, y) for x, y in zip(got, ref))
    rows.append({"kind": "check", "kernel": "lookup.page_scores", "max_rel_err": err,
                     "ok": bool(err < 1e-4 and all(_same_inf(x, y) for x, y in zip(got, ref)))})
    # sparse decode, with NaN in masked slots and unused pool page 0
    bound, center = ref
    cold = select(bound, center, arrays["page_table"], dims["cold_pages"])
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
        o, lse = decode_kernel.sparse_decode(*dargs, sm_scale=1 / math.sqrt(d),
                                             interpret=interpret, config=cfg)
        ro, rlse = jax.jit(lambda *x: decode_ref.sparse_decode(*x, sm_scale=1 / math.sqrt(d)))(
            *dargs)
        tol = {"bf16x3": 1e-4, "f32": 1e-4, "bf16": 3e-2}[prec]
        err = max(_rel_err(o, ro), _rel_err(lse, rlse))
        rows.append({"kind": "check", "kernel": f"sparse_decode[{prec}]", "max_rel_err": err,
                         "finite": bool(np.isfinite(np.asarray(o)).all()),
                         "ok": bool(err < tol and np.isfinite(np.asarray(o)).all())})
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
        rows.append({"kind": "check", "kernel": name, "mismatches": mism, "ok": mism == 0})
    return rows


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.astype(np.float32).view(np.uint32)


def _same_inf(x, y):
    return bool(np.array_equal(np.isneginf(np.asarray(x)), np.isneginf(np.asarray(y))))


def _rel_err(x, y):
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    fin = np.isfinite(y)
    if not fin.any():
        return 0.0 if np.array_equal(x, y) else float("inf")
    scale = max(np.abs(y[fin]).max(), 1e-6)
    return float(np.abs(x[fin] - y[fin]).max() / scale)


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
                    help="subset of dense_bf16 sparse_xla sparse_pallas lookup_pallas decode_pallas")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--out", default=None, help="JSON-lines file (default benchmarks/results/...)")
    args = ap.parse_args(argv)

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
                           "decode_pallas"]

    now = _dt.datetime.now(_dt.UTC)
    out_path = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"gpu_check-{now:%Y%m%dT%H%M%SZ}{'-dry' if args.dry_run else ''}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False, cwd=os.path.dirname(os.path.abspath(__file__))
                                ).stdout.strip() or None
    except OSError:
        commit = None
    common = {"date": now.isoformat(timespec="seconds"),
                  "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                  "commit": commit, "backend": backend, "device": str(jax.devices()[0].device_kind),
                  "jax": jax.__version__, "host": platform.node(), "dry_run": args.dry_run,
                  "interpret": interpret}
    rows = []

    def emit(row):
        row = {**common, **row}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "host")}),
              flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    if not args.skip_checks:
        for row in checks(interpret, args.dry_run):
            emit(row)

    for context in contexts:
        for batch in batches:
            key = jax.random.PRNGKey(context + batch)
            arrays, dims = make_case(key, batch=batch, context=context,
                                     with_dense="dense_bf16" in impls, **shapes)
            steps = make_steps(dims, interpret)
            outs = {}
            for impl in impls:
                a = arrays
                if impl == "decode_pallas":
                    bound, center = lookup_ref.page_scores(
                        arrays["q"], arrays["digest_center"], arrays["digest_radius"],
                        arrays["page_table"])
                    a = dict(arrays, cold_ids=select(bound, center, arrays["page_table"],
                                                     dims["cold_pages"]))
                try:
                    out, t = time_fn(steps[impl], a, iters, warmup)
                except Exception as e:  # noqa: BLE001 -- one failing case must not hide the rest
                    emit(dict(kind="time", impl=impl, **dims, error=repr(e)[:2000]))
                    continue
                outs[impl] = out
                nbytes = bytes_model(dims, impl)
                row = dict(kind="time", impl=impl, **dims, **t, bytes=nbytes,
                           bytes_per_s=nbytes / t["median_s"],
                           frac_of_peak=nbytes / t["median_s"] / PEAK_BYTES_PER_S)
                if impl == "sparse_pallas" and "sparse_xla" in outs:
                    row["max_abs_diff_vs_xla"] = float(
                        jnp.max(jnp.abs(out - outs["sparse_xla"])))
                emit(row)
            del arrays, steps, outs
    print(f"wrote {len(rows)} rows to {out_path}")
    bad = [r for r in rows if r.get("kind") == "check" and not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
