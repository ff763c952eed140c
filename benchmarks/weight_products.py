"""A decode step's weight products alone: a model's layers' seven products (no
norms, no attention) in one jitted layer loop, three ways, interleaved in one
process (docs/log/results.md, "The weight products on AMX tiles"):
- `xla_in_out`: XLA, weights stacked [L, in, out] and sliced by the loop (how the
  model stored them before);
- `xla_out_in`: XLA, weights stacked [L, out, in] (the model's layout now);
- `kernel`: our kernel reading each layer of the [L, out, in] stack in place
  (`cpu_kernels/matmul.cc`), where it runs: on AMX tiles, or on AVX-512 for up to
  16 rows (`path` in the row; more rows there are XLA's);
- `kernel_q4_1`: the same kernel reading the weights as GGUF Q4_1 blocks
  (`cpu_kernels/blocks.py`, what the model's decode step reads from a Q4_1 file;
  at most 16 rows), dequantized tile by tile.
(Files before 2026-12-07 call those two `amx` and `amx_q4_1`.) Random bf16
weights at the model's shapes (random Q4_1 blocks for `kernel_q4_1`). One JSON
line per (rows, way): median ms of the whole loop, and the bytes it read over it
(GB/s).

    python benchmarks/weight_products.py [--model smollm2-135m] [--rows 1 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import blocks, build
from hisparse_jax.models.llama import (
    BLOCKS_MAX_ROWS,
    MATMUL_MIN_ROWS,
    MATRICES,
    layer_shapes,
    matmul,
)
from hisparse_jax.models.registry import load


def chain(x, mm):
    """A layer's seven products, each input made from earlier outputs (so none is
    dropped; no norms, no attention): x [rows, d] -> [rows, d]."""
    q, k, v = mm(x, "wq"), mm(x, "wk"), mm(x, "wv")
    kv = jnp.pad(k + v, ((0, 0), (0, q.shape[1] - k.shape[1])))
    h = mm(q + kv, "wo")
    return x + mm(mm(h, "w_gate") * mm(h, "w_up"), "w_down") * 1e-3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    cfg = load(a.model)[0].cfg
    shapes = layer_shapes(cfg)
    rng = np.random.default_rng(0)
    in_out = {n: jnp.asarray(rng.standard_normal((cfg.num_layers, *shapes[n])) * 0.02,
                             jnp.bfloat16) for n in MATRICES}
    out_in = {n: w.swapaxes(1, 2).copy() for n, w in in_out.items()}
    nbytes = sum(w.nbytes for w in in_out.values())
    layers = jnp.arange(cfg.num_layers)

    def xla_in_out(x, w):  # the loop slices each layer; x @ w
        def body(x, ws):
            return chain(x, lambda y, n: jax.lax.dot_general(
                jnp.pad(y.astype(jnp.bfloat16), ((0, max(0, MATMUL_MIN_ROWS - y.shape[0])), (0, 0))), ws[n],
                (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)[:y.shape[0]]), None
        return jax.lax.scan(body, x, w)[0]

    def loop(products):
        def run(x, w):
            return jax.lax.scan(lambda x, i: (chain(x, lambda y, n: matmul(
                y, w[n], i, products=products)), None), x, layers)[0]
        return run

    def q4_1_blocks(name):
        """Random Q4_1 blocks (f16 scales, every code) of each layer's matrix, tiled."""
        n, k = out_in[name].shape[1:]
        raw = rng.integers(0, 256, (cfg.num_layers, n, k // 32, 20), dtype=np.uint8)
        raw[..., :4] = (rng.standard_normal((cfg.num_layers, n, k // 32, 2)) * 0.01).astype(
            np.float16).view(np.uint8)
        tiles = [blocks.tile(r.reshape(n, -1), "Q4_1", n, k) for r in raw]
        return tuple(jnp.asarray(np.stack(part)) for part in zip(*tiles))

    def blocks_loop(x, q):
        return jax.lax.scan(lambda x, i: (chain(x, lambda y, n: matmul(
            y, out_in[n], i, products="cpu", blocks=q[n])), None), x, layers)[0]

    ways = {"xla_in_out": (jax.jit(xla_in_out), in_out, nbytes),
            "xla_out_in": (jax.jit(loop("xla")), out_in, nbytes)}
    path = "amx" if build.amx_unavailable() is None else "avx512"
    if build.products_unavailable() is None:
        ways["kernel"] = (jax.jit(loop("cpu")), out_in, nbytes)
        q = {n: q4_1_blocks(n) for n in MATRICES}
        ways["kernel_q4_1"] = (jax.jit(blocks_loop), q, sum(arr.nbytes for t in q.values() for arr in t))
    for rows in a.rows:
        x = jnp.asarray(rng.standard_normal((rows, cfg.hidden_size)), jnp.float32)
        run = {k: v for k, v in ways.items() if k != "kernel_q4_1" or rows <= BLOCKS_MAX_ROWS}
        times = {k: [] for k in run}
        for r in range(a.repeats + 2):
            for k, (f, w, _) in run.items():
                t = time.perf_counter()
                f(x, w).block_until_ready()
                if r >= 2:
                    times[k].append(time.perf_counter() - t)
        for k, ts in times.items():
            ms = 1e3 * float(np.median(ts))
            print(json.dumps({"model": a.model, "rows": rows, "way": k,
                              "path": path if k.startswith("kernel") else "xla",
                              "ms": round(ms, 2), "gb_s": round(run[k][2] / ms / 1e6, 1),
                              "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
