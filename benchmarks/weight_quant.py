"""Would quantized weights close the CPU gap to llama.cpp? The layers' seven
products of SmolLM2 in bf16 (the model's) against int8 weights, on the same
model, in one process: their speed in a weights-only decode step, and what they
cost in quality (next-token top-1 agreement and mean KL(bf16 || quantized) over
every position of real documents, exact attention).

    python benchmarks/weight_quant.py [--tokens 1024] [--repeats 8] [--json FILE]

Variants (one float32 scale per output channel for the int8 weights; the
embedding and the LM head stay bf16 in all of them):
- `w8a16`: int8 weights converted to bf16 inside the product;
- `w8a8-row`: each activation row quantized to int8 with its own absmax scale,
  the product in int32 (XLA:CPU's fast integer path);
- `w8a8-g64`: as `w8a8-row` with one activation scale per 64 channels (llama.cpp
  quantizes activations in blocks of 32 for its Q4/Q8 dot products), one
  batched int32 product per group.
One JSON row per (variant, document) and per (variant, batch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from model_quality import DOCS, _open_doc, exact_logprobs

from hisparse_jax.models import llama
from hisparse_jax.models.registry import load

MATRICES = llama.MATRICES


def _pad_rows(x):
    """x [..., in] -> rows [n', in] (one row padded to two, as `llama.matmul`), n."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    return (jnp.concatenate([x2, x2]) if n == 1 else x2), n


def absmax_int8(x, axis: int):
    """Symmetric int8 codes of x, one float32 scale per slice along `axis` (its
    largest |value| maps to 127) -> (codes, scale with `axis` dropped)."""
    x = jnp.asarray(x, jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127
    scale = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    return codes, jnp.squeeze(scale, axis)


def w8a16(x, codes, scale):
    x2, n = _pad_rows(x)
    y = jax.lax.dot_general(x2.astype(jnp.bfloat16), codes.astype(jnp.bfloat16),
                            (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * scale)[:n].reshape(*x.shape[:-1], -1)


def w8a8(group: int | None):
    def product(x, codes, scale):
        x2, n = _pad_rows(x)
        g = group or x2.shape[-1]
        xq, xs = absmax_int8(x2.reshape(x2.shape[0], -1, g), -1)       # [n, G, g], [n, G]
        wq = codes.reshape(-1, g, codes.shape[-1])                      # [G, g, out]
        y = jax.lax.dot_general(xq, wq, (((2,), (1,)), ((1,), (0,))),
                                preferred_element_type=jnp.int32)      # [G, n, out]
        y = (y.astype(jnp.float32) * xs.T[..., None]).sum(0) * scale
        return y[:n].reshape(*x.shape[:-1], -1)
    return product


VARIANTS = {"w8a16": w8a16, "w8a8-row": w8a8(None), "w8a8-g64": w8a8(64)}


class QuantBlock(llama.Block):
    """The model's layers with int8 matrices (codes [L, in, out], one scale per
    output channel) multiplied by VARIANTS[kind]."""

    def __init__(self, cfg, layers, kind: str):
        super().__init__(cfg, layers)
        self.kind = kind
        for name in MATRICES:
            codes, scale = absmax_int8(layers[name], -2)  # a scale per output channel
            setattr(self, name, nnx.Param(codes))
            setattr(self, name + "_scale", nnx.Param(scale))

    def product(self, x, name, layer, products="xla"):
        return VARIANTS[self.kind](x, getattr(self, name)[...][layer],
                                   getattr(self, name + "_scale")[...][layer])


def quantized(model, kind: str):
    weights = model.weights()
    m = llama.Llama(model.cfg, weights)
    m.blocks = QuantBlock(model.cfg, weights["layers"], kind)
    return m


def step_timer(model, batch: int):
    """A weights-only decode step (attention = q plus the repeated k and v, so that
    no product is dropped), jitted over all layers and compiled -> a function that
    runs it once and returns its milliseconds."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tokens, positions):
        m = nnx.merge(graphdef, params)

        def attend(caches, layer, q, k, v):
            g = q.shape[-2] // k.shape[-2]
            return q + jnp.repeat(k, g, -2) + jnp.repeat(v, g, -2), caches

        x, _ = m.layers(m.embed_tokens(tokens), positions, None, attend)
        return m.logits(x).argmax(-1)

    tokens = jnp.arange(batch, dtype=jnp.int32) + 100
    positions = jnp.full((batch,), 1000, jnp.int32)
    step(params, tokens, positions).block_until_ready()

    def once():
        t = time.perf_counter()
        step(params, tokens, positions).block_until_ready()
        return (time.perf_counter() - t) * 1e3
    return once


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="per document (its first N)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", default=None, help="append the rows to this file")
    args = p.parse_args(argv)
    command = "python benchmarks/weight_quant.py " + " ".join(argv or sys.argv[1:])
    model, tok = load("smollm2-135m")
    models = {"bf16": model, **{k: quantized(model, k) for k in VARIANTS}}
    rows = []

    def emit(row):
        row.update(command=command.strip(), date=datetime.date.today().isoformat())
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name, path, _ in DOCS:
        with _open_doc(path) as f:
            ids = np.asarray(tok.encode(f.read())[:args.tokens], np.int32)
        ref = exact_logprobs(model, ids, 0)
        for kind in VARIANTS:
            lp = exact_logprobs(models[kind], ids, 0)
            kl = (np.exp(ref) * (ref - lp)).sum(-1)
            emit({"variant": kind, "doc": name, "positions": len(kl),
                  "top1_agreement": round(float((ref.argmax(-1) == lp.argmax(-1)).mean()), 4),
                  "mean_kl_nats": round(float(kl.mean()), 5)})

    for batch in (1, 8):
        timers = {k: step_timer(m, batch) for k, m in models.items()}
        times = {k: [] for k in timers}
        for _ in range(args.repeats):  # interleaved: the machine's noise hits all alike
            for k, once in timers.items():
                times[k].append(once())
        for k, ts in times.items():
            emit({"variant": k, "batch": batch, "weights_step_ms": round(float(np.median(ts)), 2),
                  "vs_bf16": round(float(np.median(times["bf16"]) / np.median(ts)), 3)})
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
