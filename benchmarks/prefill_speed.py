"""Whole-model prefill time by exact causal attention, interleaved in one process:
the kernel (`cpu_kernels/causal_attention.cc`, the default: on AMX tiles where the
CPU has AMX-BF16, `amx_kernel`, else on AVX-512, `avx512_kernel`, which an AMX CPU
runs too), XLA's blocks (`attention.causal_prefill_attention`), and XLA's blocks in
the layout they had before (`prefill_attention_variants.old_layout`, bit-identical
to XLA's). The real model's 30 layers over the passkey filler (as `hisparse bench
generate`), the cache fill left out (it is the same for all).

    python benchmarks/prefill_speed.py --tokens 2048 7680

`--float64` adds an attention in float64 (numpy, slow: 2K tokens or so) and each
row's logits' largest distance from it: how far float32's own rounding moves
SmolLM2's logits, the yardstick for the differences between the others.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from prefill_attention_variants import old_layout

from cpu_kernels import build
from cpu_kernels import ops as cpu_ops
from hisparse_jax.attention import causal_prefill_attention
from hisparse_jax.harness.generate_bench import prompt
from hisparse_jax.models.registry import load


def float64_attention(q, k, v):
    """Exact causal attention in float64 on the host (queries scaled in float32 first,
    as `attention.query_rows` does)."""
    def run(q, k, v):
        t, hq, d = q.shape
        hkv = k.shape[1]
        qs = (np.asarray(q, np.float32) * np.float32(1 / np.sqrt(d))).astype(np.float64)
        k, v = (np.asarray(x.astype(np.float32), np.float64) for x in (k, v))
        logits = np.einsum("thgd,shd->hgts", qs.reshape(t, hkv, hq // hkv, d), k)
        logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hgts,shd->thgd", p, v).reshape(t, hq, d).astype(np.float32)
    return jax.pure_callback(run, jax.ShapeDtypeStruct(q.shape, jnp.float32), q, k, v)


ATTENTIONS = {"amx_kernel": lambda q, k, v: cpu_ops.causal_attention(q, k, v, 0),
              "avx512_kernel": lambda q, k, v: cpu_ops.causal_attention(q, k, v, 0, amx=False),
              "xla": causal_prefill_attention, "old_layout": old_layout}
# why a kernel's path cannot run here (None: it can)
UNAVAILABLE = {"amx_kernel": build.amx_unavailable, "avx512_kernel": build.causal_unavailable}


def forward(model, attention):
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, ids):
        m = nnx.merge(graphdef, params)
        attend = lambda c, layer, q, k, v: (
            attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)), c)
        x, _ = m.layers(m.embed_tokens(ids), jnp.arange(ids.shape[0]), (), attend)
        return m.logits(x[-1:])
    return lambda ids: run(params, ids)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 7680],
                   help="prompt lengths (multiples of 512)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", nargs="+", choices=list(ATTENTIONS),
                   default=["amx_kernel", "avx512_kernel", "xla"], help="the first is the "
                   "baseline of speedup and max_logit_diff (a kernel's path is left out "
                   "where it cannot run: amx_kernel without AMX)")
    p.add_argument("--float64", action="store_true",
                   help="also each one's logits against float64 attention's")
    args = p.parse_args(argv)
    model, tok = load(args.model)
    for n in args.tokens:
        if n % 512:
            p.error(f"--tokens {n}: not a multiple of 512")
        ids = jnp.asarray(prompt(tok, model.cfg.vocab_size, n), jnp.int32)
        names = [a for a in args.attention if a not in UNAVAILABLE or not UNAVAILABLE[a]()]
        runs = {name: forward(model, ATTENTIONS[name]) for name in names}
        logits = {name: np.asarray(f(ids)) for name, f in runs.items()}  # compile
        times = {name: [] for name in runs}
        for _ in range(args.repeats):  # interleaved: the machine's load drifts
            for name, f in runs.items():
                t0 = time.perf_counter()
                f(ids).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        row = {"model": args.model, "tokens": n,
               **{f"{name}_s": round(min(t), 2) for name, t in times.items()},
               **{f"{name}_tok_s": round(n / min(t), 1) for name, t in times.items()},
               **{f"speedup_over_{name}": round(min(times[name]) / min(times[names[0]]), 2)
                  for name in names[1:]},
               **{f"max_logit_diff_{name}": float(np.abs(logits[name] - logits[names[0]]).max())
                  for name in names[1:]}}
        if args.float64:
            exact = np.asarray(forward(model, float64_attention)(ids))
            row.update({f"max_logit_diff_float64_{name}": float(np.abs(x - exact).max())
                        for name, x in logits.items()})
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
