"""Kernel benchmark: the Pallas kernels against their XLA references, op by op.

`hisparse bench kernels [--case NAME] [--impl pallas,xla] [--json FILE]`.

Ops, each timed per implementation on the same synthetic inputs:
  lookup         page scores of every candidate page (`page_scores`);
  sparse_decode  decode attention over sink + hot (bf16), warm (fp8) and the
                 selected cold (int4) pages (`sparse_decode`), the selection given;
  step           lookup -> top-k selection -> sparse_decode: one HiSparse decode step;
  dense          the baseline: exact attention over bf16 K/V of the whole context
                 (`hisparse_jax.attention.dense_decode_attention`, XLA only).
Implementations: "xla" (the pure-jnp references, the library's XLA path) and
"pallas" (the Pallas kernels: compiled for the GPU, interpret mode elsewhere).

Every row: median and spread of the call time (compile and warm-up excluded),
the bytes the op must read (computed from the shapes: `op_bytes`), bytes/s,
and the largest difference from the XLA reference on the same inputs.

Inputs are synthetic arrays of the cache's shapes and dtypes (`make_case`): random
bf16 / e4m3 / packed int4 codes, digests (centre, radius >= 0) and a page table;
no HiSparse cache is built. `benchmarks/gpu_check.py` uses the same builders.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import pool_pages, sample_tail
from hisparse_jax.backends import REFERENCE
from hisparse_jax.config import HiSparseConfig
from pallas_kernels.lookup import kernel as lookup_kernel
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.sparse_decode import kernel as decode_kernel
from pallas_kernels.sparse_decode import reference as decode_ref

PEAK_BYTES_PER_S = 4.3e12  # measured copy ceiling of the H200
INT32_LIMIT = 2**31 - 1    # Pallas Triton pool offsets are int32


@dataclasses.dataclass(frozen=True)
class KernelImpl:
    """One implementation of the Pallas kernels' pair, as this benchmark runs it:
    the reference (XLA) is the error baseline and also times dense attention; a
    kernel runs interpreted off the GPU and reports its tiling."""
    page_scores: Callable
    sparse_decode: Callable
    kernel: bool  # a Pallas kernel (takes interpret=, has a tiling and a tolerance)


KERNEL_IMPLS = {
    "pallas": KernelImpl(lookup_kernel.page_scores, decode_kernel.sparse_decode, kernel=True),
    REFERENCE: KernelImpl(lookup_ref.page_scores, decode_ref.sparse_decode, kernel=False),
}
IMPLS = tuple(KERNEL_IMPLS)
OPS = ("lookup", "sparse_decode", "step", "dense")
# Largest relative difference (vs the largest |reference| value) a Pallas op may
# show against its XLA reference: f32 outputs with the default bf16x3 dots; page
# scores are bf16 products summed in f32 in both (only the summation order differs).
TOLERANCE = {"lookup": 1e-4, "sparse_decode": 1e-4, "step": 1e-4}


# ----------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """Shapes of one benchmark case (all sizes in tokens, like HiSparseConfig)."""
    name: str
    batch: int
    context: int
    kv_heads: int
    group: int
    head_dim: int
    page: int
    sink: int
    hot: int
    warm: int
    budget: int
    value_group: int
    bound_share: float

    def shapes(self) -> dict:
        """Keyword arguments of `make_case` (besides key, batch, context)."""
        return {f: getattr(self, f) for f in ("kv_heads", "group", "head_dim", "page", "sink",
                                              "hot", "warm", "budget", "value_group")}


def _default_tiers() -> dict:
    c = HiSparseConfig()  # DESIGN defaults: page 16, sink 16, hot 128, warm 384, budget 2048
    return {"page": c.page_size, "sink": c.sink_pages * c.page_size, "hot": c.hot_tokens,
            "warm": c.warm_tokens, "budget": c.budget_tokens, "value_group": c.value_group,
            "bound_share": c.bound_share}


def _cases() -> dict[str, KernelCase]:
    cases = {"ci": KernelCase("ci", batch=2, context=2048, kv_heads=2, group=4, head_dim=64,
                              page=16, sink=16, hot=64, warm=128, budget=256, value_group=32,
                              bound_share=HiSparseConfig().bound_share)}
    for label, ctx in (("32k", 1 << 15), ("128k", 1 << 17), ("1m", 1 << 20)):
        for b in (1, 8):
            name = f"decode_{label}_b{b}"
            # Llama-3-8B heads: 32 query heads on 8 KV heads, head_dim 128.
            cases[name] = KernelCase(name, batch=b, context=ctx, kv_heads=8, group=4,
                                     head_dim=128, **_default_tiers())
    return cases


CASES = _cases()


# ----------------------------------------------------------------------------- inputs


def make_case(key, *, batch, context, kv_heads, group, head_dim, page, sink, hot, warm, budget,
              value_group, with_dense=True):
    """Synthetic inputs of one decode step: (arrays, dims).

    The page table holds the cache's candidates: every logical page but the sink
    pages and the newest hot + warm pages (those live in the bf16 / fp8 tiers).
    Cold pool pages alias (page id modulo the pool size) when a full pool would
    pass int32 offsets; that changes no byte count.
    """
    b, h, g, d = batch, kv_heads, group, head_dim
    sink_pages = -(-sink // page)
    tb, tw = sink_pages * page + hot, warm
    n = context // page                         # logical pages per sequence
    recent = hot // page + warm // page
    candidates = max(0, n - sink_pages - recent)
    k_sel = min(budget // page, candidates)
    # The importance sample of unselected pages (attention.sample_tail), read too.
    n_sample = min(HiSparseConfig().tail_sample_pages, candidates - k_sel)
    per_page = h * page * (d // 2)
    pool = max(1, min(b * n, INT32_LIMIT // per_page))
    arrays = _make_arrays(key, b=b, h=h, g=g, d=d, page=page, tb=tb, tw=tw, n=n, pool=pool,
                          sink_pages=sink_pages, recent=recent, ng=d // value_group,
                          context=context, with_dense=with_dense)
    dims = {"batch": b, "context": context, "kv_heads": h, "q_heads": h * g, "head_dim": d,
            "page": page, "bf16_tokens": tb, "fp8_tokens": tw, "candidate_pages": candidates,
            "cold_pages": k_sel, "sample_pages": n_sample, "pool_pages": pool,
            "pool_aliased": pool < b * n, "value_group": value_group}
    return arrays, dims


def _fmix32(x):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def unit_interval(x):
    """uint32 -> float32 strictly inside (0, 1). 23 bits + 0.5 fit f32's 24-bit
    significand; with 24 bits, x >= 0xFFFFFF80 rounded to exactly 1.0 and the
    "normal" inputs held +inf (erfinv(1)), about one in 2**24 entries: NaN rows in
    the H200's first gpu_check (2026-12-04) at 128K+ tokens."""
    return ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def _random(key, specs: dict) -> dict:
    """Random arrays for benchmarking: per array, a counter hashed with a seed drawn
    from `key`. Elementwise, so XLA fuses it into the conversion: no temporaries
    beyond the outputs (threefry needs ~4x the output at 1M tokens x batch 8) and
    one fast compile. specs: name -> (shape, dtype, kind, lo, hi); kind "normal"
    (lo, hi unused), "uniform" in [lo, hi), or "bytes" (uniform uint8)."""
    seeds = jax.random.bits(key, (len(specs),), jnp.uint32)
    out = {}
    for i, (name, (shape, dtype, kind, lo, hi)) in enumerate(specs.items()):
        n = math.prod(shape)
        if n >= 2**32:
            raise ValueError(f"{name}: {n} elements, more than a uint32 counter covers")
        ctr = jax.lax.iota(jnp.uint32, n).reshape(shape)
        x = _fmix32(_fmix32(ctr ^ seeds[i]) + seeds[i])
        if kind == "bytes":
            out[name] = (x >> 24).astype(jnp.uint8)
            continue
        u = unit_interval(x)
        if kind == "normal":
            v = math.sqrt(2.0) * jax.scipy.special.erfinv(2.0 * u - 1.0)
        else:
            v = lo + (hi - lo) * u
        out[name] = v.astype(dtype)
    return out


@functools.partial(jax.jit, static_argnames=("b", "h", "g", "d", "page", "tb", "tw", "n", "pool",
                                             "sink_pages", "recent", "ng", "context",
                                             "with_dense"))
def _make_arrays(key, *, b, h, g, d, page, tb, tw, n, pool, sink_pages, recent, ng, context,
                 with_dense):
    """The arrays of `make_case`, in one compiled call."""
    bf16, f32, fp8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
    blk = math.gcd(context, 4096)  # dense K/V: a random block, tiled
    specs = {
        "q": ((b, h, g, d), f32, "normal", 0, 0),
        "bf16_k": ((b, h, tb, d), bf16, "normal", 0, 0),
        "bf16_v": ((b, h, tb, d), bf16, "normal", 0, 0),
        "fp8_k": ((b, h, tw, d), fp8, "normal", 0, 0),
        "fp8_v": ((b, h, tw, d), fp8, "normal", 0, 0),
        "fp8_k_scale": ((b, h, tw), f32, "uniform", 0.001, 0.01),
        "fp8_v_scale": ((b, h, tw), f32, "uniform", 0.001, 0.01),
        # Cold pool, head-major [Hkv, P, ...] (hisparse_jax.cache.state layout).
        "int4_k": ((h, pool, page, d // 2), jnp.uint8, "bytes", 0, 0),
        "int4_v": ((h, pool, page, d // 2), jnp.uint8, "bytes", 0, 0),
        "int4_v_scale": ((h, pool, page, ng), bf16, "uniform", 0.01, 0.2),
        "int4_v_zero": ((h, pool, page, ng), bf16, "uniform", -1.5, -0.5),
        # Digest: per-channel key range centre and radius (>= 0) of each page, [Hkv, P, D].
        "digest_center": ((h, pool, d), bf16, "normal", 0, 0),
        "digest_radius": ((h, pool, d), fp8, "uniform", 0.0, 1.5),
    }
    if with_dense:
        specs["dense_k"] = ((1, h, blk, d), bf16, "normal", 0, 0)
        specs["dense_v"] = ((1, h, blk, d), bf16, "normal", 0, 0)
    arrays = _random(key, specs)
    arrays["bf16_valid"] = jnp.ones((b, tb), bool)
    arrays["fp8_valid"] = jnp.ones((b, tw), bool)
    # Sequence i owns logical pages i*n .. i*n+n-1 of the pool (aliased modulo pool).
    j = jnp.arange(n, dtype=jnp.int32)
    table = (jnp.arange(b, dtype=jnp.int32)[:, None] * n + j) % pool
    is_cand = (j >= sink_pages) & (j < n - recent)
    arrays["page_table"] = jnp.where(is_cand[None, :], table, -1).astype(jnp.int32)
    if with_dense:  # no context-sized random temporary
        reps = (b, 1, context // blk, 1)
        arrays["dense_k"] = jnp.tile(arrays["dense_k"], reps)
        arrays["dense_v"] = jnp.tile(arrays["dense_v"], reps)
    return arrays


def case_nbytes(case: KernelCase, with_dense: bool) -> int:
    """Bytes of the inputs `make_case` builds for `case` (from shapes alone)."""
    shapes = jax.eval_shape(lambda k: make_case(k, batch=case.batch, context=case.context,
                                                with_dense=with_dense, **case.shapes())[0],
                            jax.random.PRNGKey(0))
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(shapes))


def op_bytes(dims: dict, op: str) -> int:
    """Bytes an op must read from memory, from the shapes: every K/V element, code,
    scale, digest row and table entry it uses once, plus q. Outputs not counted.

    lookup:        q, the page table, centre + radius rows of every candidate page;
    sparse_decode: q, bf16 K/V + validity, fp8 K/V + per-token scales + validity,
                   per selected cold page its ids, K/V codes, value scales + zeros
                   and digest rows (the key grid);
    step:          lookup + sparse_decode (q once; the selection runs on-chip sizes);
    dense:         q, bf16 K/V of the whole context, the lengths.
    """
    b, h, d, page = dims["batch"], dims["kv_heads"], dims["head_dim"], dims["page"]
    q_bytes = b * dims["q_heads"] * d * 4
    if op == "dense":
        return q_bytes + b * h * dims["context"] * d * 2 * 2 + b * 4
    n = dims["context"] // page
    ng = d // dims["value_group"]
    digest_row = d * (2 + 1)  # bf16 centre + e4m3 radius
    lookup = b * n * 4 + b * h * dims["candidate_pages"] * digest_row
    tb, tw = dims["bf16_tokens"], dims["fp8_tokens"]
    bf16 = b * h * tb * d * 2 * 2 + b * tb
    fp8 = b * h * tw * (d * 2 + 2 * 4) + b * tw
    cold = b * h * (dims["cold_pages"] + dims["sample_pages"]) * (
        4 + 4 + page * (d // 2) * 2 + page * ng * 2 * 2 + digest_row)  # id, log weight, ...
    if op == "lookup":
        return q_bytes + lookup
    if op == "sparse_decode":
        return q_bytes + bf16 + fp8 + cold
    if op == "step":
        return q_bytes + lookup + bf16 + fp8 + cold
    raise ValueError(f"unknown op {op!r}; choose from {OPS}")


# ----------------------------------------------------------------------------- ops


def select(bound, center, table, k, bound_share=None):
    """Cold pool pages to attend [B, Hkv, k] and their logical pages (like
    hisparse_jax.attention.select_pages):
    a `bound_share` (None: HiSparseConfig's default) of the budget by Quest's bound
    (per query head when the bound is [B, Hkv, G, N]), the rest by centre score
    among the pages not yet taken. Duplicate picks of several heads are kept, and
    the library's side pages (beside each head's top bound page) and its
    stickiness bonus (two elementwise selects) are not added: the same cost, the
    same result on both sides."""
    if bound_share is None:
        bound_share = HiSparseConfig().bound_share
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
    logical = jnp.where(top > -jnp.inf, jnp.concatenate([pages_b, pages_c], axis=-1), -1)
    return pool_pages(table, logical), logical.astype(jnp.int32)


def select_with_sample(bound, center, table, k, n, bound_share=None):
    """`select`'s k pages, then n sampled from the others as the library does
    (`attention.sample_tail`): (pool pages [B, Hkv, k + n], log weights)."""
    pool, logical = select(bound, center, table, k, bound_share)
    lengths = jnp.full((table.shape[0],), table.shape[1], jnp.int32)
    sample, logw = sample_tail(HiSparseConfig(tail_sample_pages=n), center, logical, lengths)
    ids = jnp.concatenate([pool, pool_pages(table, sample)], axis=-1)
    return ids, jnp.concatenate([jnp.zeros(pool.shape, jnp.float32), logw], axis=-1)


DECODE_ARGS = ("q", "bf16_k", "bf16_v", "bf16_valid", "fp8_k", "fp8_v", "fp8_k_scale",
               "fp8_v_scale", "fp8_valid", "int4_k", "int4_v", "int4_v_scale", "int4_v_zero",
               "digest_center", "digest_radius")


def make_ops(dims: dict, impl: str, interpret: bool, bound_share: float | None = None) -> dict:
    """Jitted ops of one implementation; each takes the arrays dict (sparse_decode
    also needs a["cold_ids"]). Outputs: lookup (bound, center); sparse_decode
    (out, lse); step (out, cold ids); dense out."""
    sm = 1.0 / math.sqrt(dims["head_dim"])
    k = dims["cold_pages"]
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")
    spec = KERNEL_IMPLS[impl]
    flags = {"interpret": interpret} if spec.kernel else {}
    scores = functools.partial(spec.page_scores, **flags)
    decode = functools.partial(spec.sparse_decode, sm_scale=sm, **flags)

    def lookup(a):
        return scores(a["q"], a["digest_center"], a["digest_radius"], a["page_table"])

    def sparse_decode(a):
        return decode(*(a[n] for n in DECODE_ARGS), a["cold_ids"], cold_logw=a["cold_logw"])

    def step(a):
        bound, center = lookup(a)
        cold, logw = select_with_sample(bound, center, a["page_table"], k,
                                        dims["sample_pages"], bound_share)
        out, _ = decode(*(a[n] for n in DECODE_ARGS), cold, cold_logw=logw)
        return out, cold

    ops = {"lookup": jax.jit(lookup), "sparse_decode": jax.jit(sparse_decode),
           "step": jax.jit(step)}
    if impl == REFERENCE:
        from hisparse_jax.attention import dense_decode_attention

        @jax.jit
        def dense(a):
            b = a["q"].shape[0]
            lengths = jnp.full((b,), a["dense_k"].shape[2], jnp.int32)
            return dense_decode_attention(a["q"].reshape(b, -1, dims["head_dim"]),
                                          a["dense_k"], a["dense_v"], lengths)
        ops["dense"] = dense
    return ops


# ----------------------------------------------------------------------------- measuring


def time_fn(fn, args, iters: int, warmup: int):
    """(output, stats): the first call (compile included) timed apart, `warmup`
    calls untimed, then `iters` timed calls, each ending in block_until_ready."""
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
    pct = dict(zip(("p10_s", "p25_s", "p75_s", "p90_s"),
                   (float(x) for x in np.percentile(ts, [10, 25, 75, 90]))))
    return out, {"compile_s": compile_s, "median_s": float(np.median(ts)),
                 "min_s": float(ts.min()), "max_s": float(ts.max()), **pct, "iters": iters,
                 "warmup": warmup, "times_s": [float(t) for t in ts]}


def _same_nonfinite(x: np.ndarray, y: np.ndarray) -> bool:
    """Same entries infinite (with the same sign) and NaN in x and y."""
    nx, ny = ~np.isfinite(x), ~np.isfinite(y)
    return (np.array_equal(nx, ny) and np.array_equal(np.isnan(x), np.isnan(y))
            and np.array_equal(np.nan_to_num(x[nx]), np.nan_to_num(y[ny])))


def rel_err(x, y) -> float:
    """max |x - y| / max |y| over the entries where y is finite; inf when x and y
    differ in which entries are +-inf or NaN."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.shape != y.shape or not _same_nonfinite(x, y):
        return float("inf")
    fin = np.isfinite(y)
    if not fin.any():
        return 0.0
    scale = max(np.abs(y[fin]).max(), 1e-6)
    return float(np.abs(x[fin] - y[fin]).max() / scale)


def abs_err(x, y) -> float:
    """max |x - y| where y is finite (inf when the non-finite patterns differ)."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    if x.shape != y.shape or not _same_nonfinite(x, y):
        return float("inf")
    fin = np.isfinite(y)
    return float(np.abs(x[fin] - y[fin]).max()) if fin.any() else 0.0


def _errors(op, got, ref) -> dict:
    """Difference of one op's outputs from the XLA reference's."""
    if op == "step":  # (out, cold ids): compare outputs, count differing selections
        (o, cold), (ro, rcold) = got, ref
        return {"max_abs_err": abs_err(o, ro), "max_rel_err": rel_err(o, ro),
                "selection_mismatches": int(np.sum(np.sort(np.asarray(cold), -1)
                                                   != np.sort(np.asarray(rcold), -1)))}
    got = got if isinstance(got, (tuple, list)) else (got,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    return {"max_abs_err": max(abs_err(a, b) for a, b in zip(got, ref)),
            "max_rel_err": max(rel_err(a, b) for a, b in zip(got, ref))}


# ----------------------------------------------------------------------------- plan + run


def _split(text: str, what: str, choices) -> list[str]:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"{what}: nothing given; choose from {', '.join(choices)}")
    bad = [s for s in items if s not in choices]
    if bad:
        raise ValueError(f"{what}: unknown {', '.join(map(repr, bad))}; "
                         f"choose from {', '.join(choices)}")
    return list(dict.fromkeys(items))


def _available_memory(platform: str) -> int | None:
    """Bytes free for inputs: device memory limit on an accelerator, MemAvailable on a CPU."""
    try:
        if platform != "cpu":
            stats = jax.devices()[0].memory_stats() or {}
            return int(stats.get("bytes_limit", 0)) or None
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, AttributeError, RuntimeError):
        return None
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    cases: tuple
    impls: tuple
    ops: tuple
    backend: str
    interpret: bool
    iters: int | None
    warmup: int | None
    skipped: tuple = ()  # reasons for the cases "all" left out (too big for this machine)


def plan(case: str = "ci", impl: str = "pallas,xla", ops: str = ",".join(OPS), *,
         iters: int | None = None, warmup: int | None = None, backend: str | None = None
         ) -> Plan:
    """Check a request before any work; ValueError with the reason if it cannot run.

    case: a name, comma-separated names, or "all" (every case whose inputs fit in
    memory here; named cases that do not fit are refused); impl: "pallas", "xla"
    or both.
    On a CPU the Pallas kernels run in interpret mode (a correctness tool, not a
    speed one), so only the `ci` case may run them there.
    """
    backend = backend or jax.default_backend()
    names = list(CASES) if str(case).strip() == "all" else _split(case, "--case", list(CASES))
    impls = _split(impl, "--impl", IMPLS)
    op_list = _split(ops, "--ops", OPS)
    if iters is not None and iters < 1:
        raise ValueError(f"--iters must be >= 1, got {iters}")
    if warmup is not None and warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    interpret = backend != "gpu"
    if interpret and any(KERNEL_IMPLS[i].kernel for i in impls if i in KERNEL_IMPLS):
        big = [n for n in names if n != "ci"]
        if big:
            raise ValueError(
                f"the Pallas kernels need a GPU: on this {backend} backend they run in "
                f"interpret mode, allowed only for the 'ci' case (asked for "
                f"{', '.join(big)}); use --impl xla for the other cases, or run on the H200")
    if op_list == ["dense"] and "xla" not in impls:
        raise ValueError("the dense baseline is XLA only: add xla to --impl")
    free = _available_memory(backend)
    skipped = []
    if free:
        with_dense = "dense" in op_list and "xla" in impls
        for n in list(names):
            need = case_nbytes(CASES[n], with_dense)
            if need * 1.25 > free:  # inputs + the ops' temporaries
                why = (f"case {n} needs ~{need / 2**30:.1f} GiB of inputs, "
                       f"{free / 2**30:.1f} GiB available on this {backend} backend")
                if with_dense:
                    why += " (try --ops lookup,sparse_decode,step without the dense baseline)"
                if str(case).strip() != "all":
                    raise ValueError(why)
                names.remove(n)  # "all": every case that fits
                skipped.append(why)
    return Plan(tuple(names), tuple(impls), tuple(op_list), backend, interpret, iters, warmup,
                tuple(skipped))


def kernel_configs(dims: dict, op: str) -> dict:
    """The Pallas launch configurations an op runs with (the kernels' defaults)."""
    n = dims["context"] // dims["page"]
    out = {}
    if op in ("lookup", "step"):
        out["lookup"] = dataclasses.asdict(lookup_kernel.LookupConfig.default(
            n, dims["head_dim"], dims["q_heads"] // dims["kv_heads"]))
    if op in ("sparse_decode", "step"):
        out["sparse_decode"] = dataclasses.asdict(decode_kernel.DecodeConfig())
    return out


def _git_commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(p: Plan, *, command: str = "", log=None) -> list[dict]:
    """Run a checked plan; one row per (case, implementation, op)."""
    log = log or (lambda *_: None)
    common = {"backend": p.backend, "device": str(jax.devices()[0].device_kind),
              "interpret": p.interpret, "jax": jax.__version__, "commit": _git_commit(),
              "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
              "command": command}
    rows = []
    for why in p.skipped:
        log(f"skipping: {why}")
    for ci, name in enumerate(p.cases):
        case = CASES[name]
        small = name == "ci" or p.backend == "gpu"
        iters = p.iters or (20 if p.backend == "gpu" else 10 if small else 3)
        warmup = p.warmup if p.warmup is not None else (3 if p.backend == "gpu" else
                                                         2 if small else 1)
        with_dense = "dense" in p.ops and REFERENCE in p.impls
        log(f"[{ci + 1}/{len(p.cases)}] {name}: building inputs "
            f"(~{case_nbytes(case, with_dense) / 2**20:.0f} MiB) ...")
        arrays, dims = make_case(jax.random.PRNGKey(case.context + case.batch), batch=case.batch,
                                 context=case.context, with_dense=with_dense, **case.shapes())
        jax.block_until_ready(arrays)
        ops = {impl: make_ops(dims, impl, p.interpret, case.bound_share) for impl in p.impls}
        ref_ops = ops.get(REFERENCE) or make_ops(dims, REFERENCE, p.interpret, case.bound_share)
        if "sparse_decode" in p.ops:  # one selection (XLA), shared by both implementations
            bound, center = ref_ops["lookup"](arrays)
            arrays["cold_ids"], arrays["cold_logw"] = select_with_sample(
                bound, center, arrays["page_table"], dims["cold_pages"], dims["sample_pages"],
                case.bound_share)
        refs = {}
        for op in p.ops:
            for impl in ([REFERENCE] if op == "dense" else p.impls):
                if impl not in ops:
                    continue
                log(f"  {name} {impl} {op}: compile + {warmup} warm-up + {iters} timed calls ...")
                out, t = time_fn(ops[impl][op], arrays, iters, warmup)
                kernel = KERNEL_IMPLS[impl].kernel
                if impl == REFERENCE:
                    refs[op] = out
                    err = ({"max_abs_err": None, "max_rel_err": None} if op == "dense" else
                           {"max_abs_err": 0.0, "max_rel_err": 0.0,
                            **({"selection_mismatches": 0} if op == "step" else {})})
                else:
                    if op not in refs:
                        refs[op] = jax.block_until_ready(ref_ops[op](arrays))
                    err = _errors(op, out, refs[op])
                nbytes = op_bytes(dims, op)
                tol = TOLERANCE.get(op) if kernel else None
                row = {"case": name, "implementation": impl, "op": op, **dims, **t,
                       "bytes": nbytes, "bytes_per_s": nbytes / t["median_s"], **err,
                       "tolerance": tol,
                       "ok": None if tol is None else bool(err["max_rel_err"] <= tol),
                       **common}
                if kernel:
                    row["kernel_config"] = kernel_configs(dims, op)
                if p.backend == "gpu":
                    row["frac_of_peak"] = row["bytes_per_s"] / PEAK_BYTES_PER_S
                log(f"    median {t['median_s'] * 1e3:.3f} ms, "
                    f"{row['bytes_per_s'] / 1e9:.2f} GB/s"
                    + ("" if err["max_rel_err"] is None else
                       f", max rel err {err['max_rel_err']:.2e}"))
                rows.append(row)
        del arrays, ops, ref_ops, refs
    return rows


def bench_kernels(case: str = "ci", impl: str = "pallas,xla", ops: str = ",".join(OPS), *,
                  iters: int | None = None, warmup: int | None = None, command: str = "",
                  log=None) -> list[dict]:
    """plan() + run(): the rows of `hisparse bench kernels`."""
    return run(plan(case, impl, ops, iters=iters, warmup=warmup), command=command, log=log)


TABLE_HEADERS = ("case", "impl", "op", "median ms", "min ms", "max ms", "MB read", "GB/s",
                 "max rel err", "backend")


def table_rows(rows: list[dict]) -> list[tuple]:
    """The CLI table: one line per row."""
    def err(r):
        e = r["max_rel_err"]
        if e is None:
            return "-"
        flag = "" if r.get("ok") in (None, True) else " FAIL"
        return f"{e:.1e}{flag}"
    return [(r["case"], r["implementation"] + (" (interpret)" if "kernel_config" in r
                                                and r["interpret"] else ""),
             r["op"], f"{r['median_s'] * 1e3:.3f}", f"{r['min_s'] * 1e3:.3f}",
             f"{r['max_s'] * 1e3:.3f}", f"{r['bytes'] / 1e6:.2f}",
             f"{r['bytes_per_s'] / 1e9:.2f}", err(r), r["backend"]) for r in rows]
