"""Whole-model prefill time with today's exact causal attention against the layout
it had before (`prefill_attention_variants.old_layout`, bit-identical output),
interleaved in one process: the real model's 30 layers over the passkey filler (as `hisparse bench generate`), the
cache fill left out (it is the same for both).

    python benchmarks/prefill_speed.py --tokens 2048 7680
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

from hisparse_jax.attention import causal_prefill_attention
from hisparse_jax.models.bench import prompt
from hisparse_jax.models.registry import load

ATTENTIONS = {"current": causal_prefill_attention, "old_layout": old_layout}


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
    args = p.parse_args(argv)
    model, tok = load(args.model)
    for n in args.tokens:
        if n % 512:
            p.error(f"--tokens {n}: not a multiple of 512")
        ids = jnp.asarray(prompt(tok, model.cfg.vocab_size, n), jnp.int32)
        runs = {name: forward(model, f) for name, f in ATTENTIONS.items()}
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
               "speedup": round(min(times["old_layout"]) / min(times["current"]), 2),
               "max_logit_diff": float(np.abs(logits["current"] - logits["old_layout"]).max())}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
