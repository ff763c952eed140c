"""Where a model's decode step spends its time: the whole step against the same
step with parts of the attention taken out, timed interleaved in one process.

    python benchmarks/decode_profile.py --model smollm2-135m --context 8000 --batch 1 8

Variants (each one jitted program over all layers, caches donated, as the engine's):
- `weights`: the layers' matmuls, norms, RoPE and the LM head; attention returns q
  plus k and v (so that none of their products is dropped) and touches no cache:
  what any engine pays;
- `dense`: + exact attention over a bf16 cache (the engine's dense path);
- `hisparse`: + `append_token` and `attention.decode_step` (the engine's path);
- `append_only`: + `append_token`, attention returns q;
- `attend_only`: + `decode_step` on the cache as prefilled, no append;
- `select_only`: + `append_layer` and `select` (the pages the step would read);
- `hisparse_cpu`: `hisparse` on the C++ kernels (`implementation="cpu"`), where
  they build;
- `weights/bf16`, `hisparse_cpu/bf16`: those two on the same model without its
  GGUF blocks (where it has them: the products read the bf16 weights, not the
  Q4_1/Q8_0 tiles; cpu_kernels/blocks.py).
Every variant's weight products are `--products`' (default: the engine's,
`backends.resolve("weight_products")`: the AMX kernel where the CPU has AMX-BF16).
The cache is filled with `context` tokens by the engine's own prefill first.
Prints one JSON line per (batch, variant): median ms per step over `--repeats`.

`--state-loop` times the append alone in a 30-layer loop (no model), in place
(`append_layer`, the engine's) and through a per-layer slice written back whole
(how the engine did it before: the whole cache copied every step).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_kernels import build as cpu_build
from hisparse_jax import attention as att
from hisparse_jax import backends
from hisparse_jax.cache import state as st
from hisparse_jax.models import engine as eng
from hisparse_jax.models import kv
from hisparse_jax.models.llama import Llama
from hisparse_jax.models.registry import load


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "variant", "products"),
                   donate_argnames="caches")
def _step(params, caches, tokens, lens, active, *, graphdef, hcfg, variant, products):
    model = nnx.merge(graphdef, params)

    def attend(caches, layer, q, k, v):
        if variant == "weights":  # k and v used, else XLA drops their products
            return q + jnp.repeat(k + v, q.shape[-2] // k.shape[-2], axis=-2), caches
        if variant == "dense":  # the engine's
            return kv.dense_decode_layer(caches, layer, q, k, v, lens, active)
        if variant == "hisparse":  # the engine's
            return att.decode_layer(hcfg, caches, layer, q, k, v, active)
        if variant == "hisparse_cpu":  # the engine's, on the C++ kernels
            return att.decode_layer(hcfg, caches, layer, q, k, v, active, implementation="cpu")
        if variant == "select_only":  # + the append and the selection (no attention)
            caches = st.append_layer(hcfg, caches, layer, k, v, active)[0]
            sel = att.select(hcfg, caches, q, layer=layer)  # as decode_layer's
            used = (jnp.sum(sel.pages) + jnp.sum(sel.sample) + jnp.sum(sel.sample_logw)) * 0
            return q + used.astype(q.dtype), caches
        if variant == "append_only":
            return q, st.append_layer(hcfg, caches, layer, k, v, active)[0]
        out, _, after = att.decode_step(hcfg, st.layer_view(hcfg, caches, layer), q)
        return out, caches.replace(
            last_selected=caches.last_selected.at[layer].set(after.last_selected))

    x, caches = model.layers(model.embed_tokens(tokens), lens, caches, attend, products=products)
    return model.logits(x, products=products).argmax(-1), caches


def state_loop(context: int, layers: int, repeats: int, num_kv_heads=3, head_dim=64):
    """`append` in a layer loop, two ways: `in_place` (the engine's:
    `append_layer` writes at the layer index of the carried stacked state) and
    `slice` (the layer's state sliced out, appended to, written back whole)."""
    from hisparse_jax.config import HiSparseConfig
    cfg = HiSparseConfig(num_kv_heads=num_kv_heads, gqa_group=3, head_dim=head_dim,
                         max_context=-(-context // 16) * 16, max_seqs=1)
    caches = st.init_stacked(cfg, layers)
    kv = jnp.ones((1, num_kv_heads, head_dim), jnp.float32)
    active = jnp.ones(1, bool)

    @functools.partial(jax.jit, static_argnames="variant", donate_argnums=0)
    def loop(caches, variant):
        def body(carry, layer):
            if variant == "in_place":
                return st.append_layer(cfg, carry, layer, kv, kv, active)[0], None
            c = st.append_token(cfg, st.layer_view(cfg, carry, layer), kv, kv, active)
            return st.set_layer(carry, layer, c), None
        return jax.lax.scan(body, caches, jnp.arange(layers))[0]

    for variant in ("in_place", "slice"):
        ts = []
        for r in range(repeats + 3):
            t = time.perf_counter()
            caches = jax.block_until_ready(loop(caches, variant))
            if r >= 3:
                ts.append(time.perf_counter() - t)
        print(json.dumps({"state_loop": variant, "context": context, "layers": layers,
                          "ms_per_step": round(1e3 * float(np.median(ts)), 2),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--budget-tokens", type=int, default=None, help="default: context / 16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--products", choices=["cpu", "xla"], default=backends.resolve("weight_products"),
                   help="the weight products' implementation (default: the engine's)")
    p.add_argument("--state-loop", action="store_true",
                   help="time the cache updates alone in a 30-layer loop (no model)")
    args = p.parse_args(argv)
    if args.state_loop:
        return state_loop(args.context, 30, args.repeats)
    model, _ = load(args.model)
    # the same model without its GGUF blocks (bf16 weights only): the "/bf16" variants'
    plain = Llama(model.cfg, model.weights()) if hasattr(model.blocks, "wq_codes") else None
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.context)
    budget = args.budget_tokens or args.context // 16 // 16 * 16
    for batch in args.batch:
        engines = {a: eng.Engine(model, max_seqs=batch, max_context=args.context + 2 * args.repeats
                                 + 64, attention=a, budget_tokens=budget)
                   for a in ("hisparse", "dense")}
        if plain is not None:
            engines["bf16"] = eng.Engine(plain, max_seqs=batch,
                                         max_context=args.context + 2 * args.repeats + 64,
                                         budget_tokens=budget)
        first = engines["dense"].prefill(0, ids)  # the same prompt in every slot: its K/V
        kv = engines["dense"].kv(0)
        for a, e in engines.items():
            for s in range(a == "dense", batch):
                e.prefill_kv(s, *kv, first)
        variants = {"weights": "hisparse", "dense": "dense", "hisparse": "hisparse",
                    "append_only": "hisparse", "attend_only": "hisparse",
                    "select_only": "hisparse"}
        if cpu_build.unavailable() is None:
            variants["hisparse_cpu"] = "hisparse"
        if "bf16" in engines:
            variants.update({"weights/bf16": "bf16", "hisparse_cpu/bf16": "bf16"})
        times = {v: [] for v in variants}
        for r in range(args.repeats + 2):  # interleaved; the first two compile / warm up
            for v, a in variants.items():
                e = engines[a]
                lens = jnp.asarray(e.lens)
                t = time.perf_counter()
                tok, e.caches = _step(e.params, e.caches, jnp.asarray(e.tokens), lens,
                                      jnp.ones(batch, bool), graphdef=e.graphdef,
                                      hcfg=e.cache_cfg, variant=v.split("/")[0],
                                      products=args.products)
                tok.block_until_ready()
                if r >= 2:
                    times[v].append(time.perf_counter() - t)
                if v.split("/")[0] in ("hisparse", "hisparse_cpu", "append_only", "select_only",
                                       "dense"):
                    e.lens = e.lens + 1  # the cache took a token
        for v, ts in times.items():
            print(json.dumps({"model": args.model, "context": args.context, "batch": batch,
                              "budget_tokens": budget, "variant": v,
                              "products": args.products,
                              "ms_per_step": round(1e3 * float(np.median(ts)), 1),
                              "ms_p10_p90": [round(1e3 * float(np.quantile(ts, q)), 1)
                                             for q in (0.1, 0.9)],
                              "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
