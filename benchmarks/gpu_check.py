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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.bench_kernels import (  # shared with `hisparse bench kernels`
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


# Inputs (make_case) and the byte model (op_bytes) live in hisparse_jax.bench_kernels.
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
            "decode_pallas": pallas["sparse_decode"]}


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
    err = max(rel_err(x, y) for x, y in zip(got, ref))
    rows.append({"kind": "check", "kernel": "lookup.page_scores", "max_rel_err": err,
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
        ro, rlse = jax.jit(lambda *x: decode_ref.sparse_decode(
            *x, sm_scale=1 / math.sqrt(d), cold_logw=logw))(*dargs)
        tol = {"bf16x3": 1e-4, "f32": 1e-4, "bf16": 3e-2}[prec]
        err = max(rel_err(o, ro), rel_err(lse, rlse))
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
    rows.append(offload_check(interpret))
    return rows


def offload_check(interpret):
    """The offload path on this backend: host pool in pinned_host memory, host-side
    gather/scatter, copies to the device; outputs must equal the all-resident
    cache's bit for bit over a few decode steps with appends."""
    from hisparse_jax.cache import HiSparseCache
    from hisparse_jax.config import HiSparseConfig
    from hisparse_jax.offload import OffloadedCache
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
                    ids, logw = select_with_sample(bound, center, arrays["page_table"],
                                                   dims["cold_pages"], dims["sample_pages"])
                    a = dict(arrays, cold_ids=ids, cold_logw=logw)
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
