"""A prompt's prefill through the serving engine, and the cache fill inside it:
`Engine.prefill` (the model and the fill in one program) for HiSparse and for
dense, and the fill alone over every layer (`kv.fill`, what a
block-by-block prefill ends with) against the way it filled before (each layer's
whole state released, prefilled and written back, `whole_layer_fill` below), one
after the other in one process. The two fills must leave the same bytes.

    python benchmarks/prefill_fill.py [--tokens 6 100 400 1024 2000] [--max-context 1024 8192]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.cache import state as st
from hisparse_jax.harness.generate_bench import prompt
from hisparse_jax.models import engine as eng
from hisparse_jax.models import kv
from hisparse_jax.models.registry import load


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def whole_layer_fill(hcfg, caches, slot, k, v, length, shared):
    """The fill before `state.prefill_layer`: every layer's state out of the stack,
    released and prefilled with plain writes (`state.prefill_plain`), and back (a
    vmap over the layers)."""
    def one(cache, k, v, shared):
        cache = st.prefill_plain(hcfg, st.live(hcfg, cache), slot, k, v, length, shared)[0]
        return st.stored(cache)
    return jax.vmap(one)(caches, k, v, shared)


def median_ms(f, repeats):
    f()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e3, 1)


def one_case(engines, tok, n, repeats) -> dict:
    """One prompt length: the engines' prefill (prompts of one block) and the two fills."""
    hs = engines["hisparse"]
    mc = hs.model.cfg
    ids = np.asarray(prompt(tok, mc.vocab_size, n), np.int32)
    row = {"max_context": hs.max_context, "slots": hs.max_seqs, "tokens": n}
    if n <= eng.PREFILL_CHUNK:  # one program: model and fill
        for name, e in engines.items():
            def run(e=e):
                e.prefill(1, ids)
                return e.caches
            row[f"prefill_{name}_ms"] = median_ms(run, repeats)
    t = eng.fill_length(n, hs.max_context)
    rng = np.random.default_rng(n)
    k, v = (jnp.asarray(rng.normal(size=(mc.num_layers, t, mc.num_kv_heads, mc.head_dim)),
                        jnp.bfloat16) for _ in range(2))
    args = (jnp.int32(1), k, v, jnp.int32(n), hs._shared(-1, t))
    fills = {"in_place": lambda c: kv.fill(kv.HiSparseKV(hs.cache_cfg), c, *args),
             "whole_layer": lambda c: whole_layer_fill(hs.cache_cfg, c, *args)}
    for name, fill in fills.items():
        def run(fill=fill):
            hs.caches = fill(hs.caches)
            return hs.caches
        row[f"fill_{name}_ms"] = median_ms(run, repeats)
    # the same bytes: each fill once from the same state
    start = jax.tree.map(np.asarray, hs.caches)
    outs = [jax.tree.leaves(jax.tree.map(lambda a: np.asarray(a).view(np.uint8),
                                         fill(jax.tree.map(jnp.asarray, start))))
            for fill in fills.values()]
    row["fills_equal"] = all(map(np.array_equal, *outs))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, nargs="+", default=[6, 100, 400, 1024, 2000])
    p.add_argument("--max-context", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    model, tok = load(args.model)
    for ctx in args.max_context:
        engines = {a: eng.Engine(model, max_seqs=args.slots, max_context=ctx, attention=a)
                   for a in ("hisparse", "dense")}
        for n in (n for n in args.tokens if n < ctx):
            row = {"model": args.model, **one_case(engines, tok, n, args.repeats)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
