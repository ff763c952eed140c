"""Decode-step time of the model engine with the attention default's selection
(1.25x candidates, no Quest lead, floor 0.5) against the `model` preset (2x,
Quest's set among the candidates, floor 0.4), step by step interleaved in one
process (the shared machine's load moves between sequential rows):

    python benchmarks/model_preset_speed.py --batch 1
    python benchmarks/model_preset_speed.py --batch 8 --context 8000 --steps 24

Both engines hold `batch` copies of the same `context`-token prompt (the
passkey filler, as `hisparse bench generate`), budget a 16th of the context.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hisparse_jax.config import preset
from hisparse_jax.harness.generate_bench import fill_slots, prompt
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load

# The engine runs the model preset; the default's selection is the fields that differ.
_DEFAULT, _MODEL = preset("default"), preset("model")
VARIANTS = {"attention_default": {f: getattr(_DEFAULT, f) for f in vars(_DEFAULT)
                                  if getattr(_DEFAULT, f) != getattr(_MODEL, f)},
            "model_preset": {}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=24, help="timed steps per variant")
    args = p.parse_args(argv)
    model, tok = load(args.model)
    ids = prompt(tok, model.cfg.vocab_size, args.context)
    budget = max(64, args.context // 16 // 16 * 16)
    engines = {}
    for name, over in VARIANTS.items():
        e = Engine(model, max_seqs=args.batch, max_context=args.context + args.steps + 8,
                   attention="hisparse", budget_tokens=budget, cache_overrides=over)
        e.warmup(args.context)
        fill_slots(e, ids)
        e.decode_step()
        engines[name] = e
    times = {n: [] for n in engines}
    for _ in range(args.steps):
        for n, e in engines.items():
            t = time.perf_counter()
            e.decode_step()
            times[n].append(time.perf_counter() - t)
    med = {n: float(np.median(v)) * 1e3 for n, v in times.items()}
    print(json.dumps({"model": args.model, "context": args.context, "batch": args.batch,
                      "budget_tokens": budget, "steps": args.steps,
                      "attention_default": VARIANTS["attention_default"],
                      "median_ms": {n: round(v, 1) for n, v in med.items()},
                      "model_over_default": round(med["model_preset"]
                                                  / med["attention_default"], 3)}))


if __name__ == "__main__":
    main()
