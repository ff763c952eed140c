"""Prefill and decode speed of a model through HiSparse and dense attention.

    python -m hisparse_jax.models.bench --contexts 512 2048 --batches 1 8

One JSON line per (attention, context, batch): every slot is prefilled with a
`context`-token prompt (English filler), then `--decode` tokens are decoded for
all slots at once. Compiling is done first (`Engine.warmup`) and not timed.
prefill_tok_s counts the prompt tokens of all slots (they are prefilled one
after another); decode_tok_s counts generated tokens over all slots.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
          "Here we go. There and back again. ")


def measure(model, tok, attention: str, context: int, batch: int, decode: int,
            budget_tokens: int = 2048) -> dict:
    from hisparse_jax.models.engine import Engine
    if tok is None:  # random weights: any ids will do
        ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, context)
    else:
        ids = tok.encode(FILLER * (context // 8 + 8))[:context]
    engine = Engine(model, max_seqs=batch, max_context=context + decode + 1,
                    attention=attention, budget_tokens=budget_tokens)
    compile_s = engine.warmup(context)
    t0 = time.perf_counter()
    for slot in range(batch):
        engine.prefill(slot, ids)
    t1 = time.perf_counter()
    for _ in range(decode):
        engine.decode_step()
    t2 = time.perf_counter()
    return {"attention": attention, "context": context, "batch": batch,
            "budget_tokens": budget_tokens if attention == "hisparse" else None,
            "prefill_tok_s": round(batch * context / (t1 - t0), 1),
            "decode_tok_s": round(batch * decode / (t2 - t1), 1),
            "decode_ms_per_step": round(1e3 * (t2 - t1) / decode, 1),
            "compile_s": round(compile_s, 1), "capacity": engine.capacity_line(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv=None):
    from hisparse_jax.models.registry import load
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--attention", nargs="+", default=["hisparse", "dense"],
                   choices=["hisparse", "dense"])
    p.add_argument("--decode", type=int, default=32, help="decode steps timed")
    p.add_argument("--budget-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    model, tok = load(args.model)
    for context in args.contexts:
        for batch in args.batches:
            for attention in args.attention:
                print(json.dumps(measure(model, tok, attention, context, batch, args.decode,
                                         args.budget_tokens)), flush=True)


if __name__ == "__main__":
    main()
