"""Where a model's decode step spends its time: the whole step against the same
step with parts of the attention taken out, timed interleaved in one process.

    python benchmarks/decode_profile.py --model smollm2-135m --context 8000 --batch 1 8

Variants (each one jitted program over all layers, caches donated, as the engine's):
- `weights`: the layers' matmuls, norms, RoPE and the LM head; attention returns q
  and touches no cache: what any engine pays;
- `dense`: + exact attention over a bf16 cache (the engine's dense path);
- `hisparse`: + `append_token` and `attention.decode_step` (the engine's path);
- `append_only`: + `append_token`, attention returns q;
- `attend_only`: + `decode_step` on the cache as prefilled, no append.
The cache is filled with `context` tokens by the engine's own prefill first.
Prints one JSON line per (batch, variant): median ms per step over `--repeats`.

`--state-loop` times the cache updates alone, in the engine's layer loop (a scan
over the layer-stacked states, no model): `none`, `token` (the new token's bf16
write), `append` (`append_token`), `cond_false` (its page-move `lax.cond` with a
false predicate), `fp8_ring` (a page write into the fp8 warm ring) and
`pool_scatter` (a dropped page write into one int4 pool array). Alone, on one
layer's state, `append_token` takes ~0.16 ms.
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

from hisparse_jax import attention as att
from hisparse_jax import state as st
from hisparse_jax.models import engine as eng
from hisparse_jax.models.registry import load


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "variant"),
                   donate_argnames="caches")
def _step(params, caches, tokens, lens, active, *, graphdef, hcfg, variant):
    model = nnx.merge(graphdef, params)

    def attend(cache, q, k, v):
        if variant == "weights":
            return q, cache
        if variant == "dense":
            kc, vc = cache
            b = q.shape[0]
            kc = kc.at[jnp.arange(b), :, lens].set(k.astype(kc.dtype), mode="drop")
            vc = vc.at[jnp.arange(b), :, lens].set(v.astype(vc.dtype), mode="drop")
            return eng.dense_attention(q, kc, vc, lens + 1), (kc, vc)
        live = eng._live(hcfg, cache)
        if variant in ("hisparse", "append_only"):
            live = st.append_token(hcfg, live, k, v, active)
        if variant == "append_only":
            return q, eng._stored(live)
        out, _, live = att.decode_step(hcfg, live, q)
        return out, eng._stored(live)

    x, caches = model.layers(model.embed_tokens(tokens), lens, caches, attend)
    return model.logits(x).argmax(-1), caches


def state_loop(context: int, layers: int, repeats: int, num_kv_heads=3, head_dim=64):
    from hisparse_jax.config import HiSparseConfig
    cfg = HiSparseConfig(num_kv_heads=num_kv_heads, gqa_group=3, head_dim=head_dim,
                         max_context=-(-context // 16) * 16, max_seqs=1)
    caches = eng._init_hisparse(cfg, layers)
    kv = jnp.ones((1, num_kv_heads, head_dim), jnp.float32)
    active = jnp.ones(1, bool)
    none_moved = jnp.full(1, cfg.pool_pages, jnp.int32)

    def update(live, variant):
        if variant == "token":
            slot = live.seq_lens % 16 + 16
            return live.replace(bf16_k=live.bf16_k.at[jnp.arange(1), :, slot].set(
                kv.astype(jnp.bfloat16)), seq_lens=live.seq_lens + 1)
        if variant == "append":
            return st.append_token(cfg, live, kv, kv, active)
        if variant == "cond_false":
            move = functools.partial(st._move_pages, cfg, implementation=None)
            shapes = jax.eval_shape(move, live, active)
            skip = lambda s, _: (s, none_moved, jax.tree.map(
                lambda a: jnp.zeros(a.shape, a.dtype), shapes[2]))
            return jax.lax.cond(live.seq_lens[0] < 0, move, skip, live, active)[0]
        if variant == "fp8_ring":
            row = jax.lax.dynamic_slice_in_dim(live.fp8_k, 0, 16, axis=2)
            return live.replace(fp8_k=jax.lax.dynamic_update_slice_in_dim(
                live.fp8_k, row, live.seq_lens[0] % 64, axis=2))
        if variant == "pool_scatter":
            page = jnp.zeros((1, *live.int4_k.shape[:1], *live.int4_k.shape[2:]), jnp.uint8)
            return live.replace(int4_k=live.int4_k.at[:, none_moved].set(
                jnp.swapaxes(page, 0, 1), mode="drop"))
        return live

    @functools.partial(jax.jit, static_argnames="variant", donate_argnums=0)
    def loop(caches, variant):
        def body(carry, layer):
            c = jax.tree.map(lambda a: a[layer], carry)
            c = eng._stored(update(eng._live(cfg, c), variant))
            return jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(
                a, n, layer, 0), carry, c), None
        return jax.lax.scan(body, caches, jnp.arange(layers))[0]

    for variant in ("none", "token", "append", "cond_false", "fp8_ring", "pool_scatter"):
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
    p.add_argument("--state-loop", action="store_true",
                   help="time the cache updates alone in a 30-layer loop (no model)")
    args = p.parse_args(argv)
    if args.state_loop:
        return state_loop(args.context, 30, args.repeats)
    model, _ = load(args.model)
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.context)
    budget = args.budget_tokens or args.context // 16 // 16 * 16
    for batch in args.batch:
        engines = {a: eng.Engine(model, max_seqs=batch, max_context=args.context + 2 * args.repeats
                                 + 64, attention=a, budget_tokens=budget)
                   for a in ("hisparse", "dense")}
        for e in engines.values():
            e.prefill(0, ids)
            for s in range(1, batch):  # the same prompt in every slot: one prefill's K/V
                (e.prefill_kv(s, *engines["dense"].kv(0), int(e.tokens[0]))
                 if e.cache_cfg is not None else e.prefill(s, ids))
        variants = {"weights": "hisparse", "dense": "dense", "hisparse": "hisparse",
                    "append_only": "hisparse", "attend_only": "hisparse"}
        times = {v: [] for v in variants}
        for r in range(args.repeats + 2):  # interleaved; the first two compile / warm up
            for v, a in variants.items():
                e = engines[a]
                lens = jnp.asarray(e.lens)
                t = time.perf_counter()
                tok, e.caches = _step(e.params, e.caches, jnp.asarray(e.tokens), lens,
                                      jnp.ones(batch, bool), graphdef=e.graphdef,
                                      hcfg=e.cache_cfg, variant=v)
                tok.block_until_ready()
                if r >= 2:
                    times[v].append(time.perf_counter() - t)
                if v in ("hisparse", "append_only", "dense"):
                    e.lens = e.lens + 1  # the cache took a token
        for v, ts in times.items():
            print(json.dumps({"model": args.model, "context": args.context, "batch": batch,
                              "budget_tokens": budget, "variant": v,
                              "ms_per_step": round(1e3 * float(np.median(ts)), 1),
                              "ms_p10_p90": [round(1e3 * float(np.quantile(ts, q)), 1)
                                             for q in (0.1, 0.9)],
                              "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
