"""A prompt's prefill through the serving engine, as `hisparse serve` runs it, at
prompt lengths that are not whole blocks, the way it runs now and the way it ran
before 2026-12-06, interleaved in one process (this machine's speed drifts by
1.5x within minutes, so two processes one after the other do not compare):
- `now`: a long prompt's last block padded as a short prompt (`Engine.block_length`)
  and products of up to 64 rows on the AMX kernel (`models.llama.KERNEL_MAX_ROWS`);
- `before`: every block 512 rows, and XLA's products for a prefill (the engine's
  products set to "xla": before, the kernel took at most 16 rows, which no
  prefill has);
- `batch`: --batch prompts of the first --short length prefilled one by one
  (`Engine.prefill`) against together (`Engine.prefill_batch`).
Engine as the server makes it (8 slots of 8,192 tokens, budget 512). One JSON
line per case: seconds per prompt (per batch), the median of --repeats after a
warm-up (the ways take turns going first), and now / before.

    python benchmarks/prefill_lengths.py [--short 40 100] [--long 1075 4219 7870] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.harness.generate_bench import prompt
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load


def timed(run, *args) -> float:
    t = time.perf_counter()
    run(*args)
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--short", type=int, nargs="*", default=[40, 100])
    p.add_argument("--long", type=int, nargs="*", default=[1075, 4219, 7870])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    model, tok = load(a.model)
    eng = {way: Engine(model, max_seqs=8, max_context=8192, attention="hisparse",
                       budget_tokens=512) for way in ("now", "before")}
    eng["before"].product_implementation = "xla"

    def prefill(way, ids, slot):
        e = eng[way]
        if len(ids) <= PREFILL_CHUNK:
            e.prefill(slot, ids)
        else:
            if way == "before":  # every block whole, as before
                e.block_length = lambda n, start: PREFILL_CHUNK
            for start in range(0, len(ids), PREFILL_CHUNK):
                e.prefill_chunk(slot, ids, start)
            vars(e).pop("block_length", None)
        jax.block_until_ready(e.logits)

    def report(case, times):
        med = {k: round(float(np.median(v[1:])), 4) for k, v in times.items()}  # [0] compiles
        a_, b_ = med.values()
        print(json.dumps({"model": a.model, "case": case, **med,
                          "ratio": round(a_ / b_, 3),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)

    for n in a.short + a.long:
        ids = np.asarray(prompt(tok, model.cfg.vocab_size, n), np.int32)
        times = {"now_s": [], "before_s": []}
        for rep in range(a.repeats + 1):
            # the second of a pair finds the weights in the cache: take turns
            for way in ("now", "before")[::1 if rep % 2 else -1]:
                times[f"{way}_s"].append(timed(prefill, way, ids, rep % 8))
        report(f"{n} tokens", times)
    if a.batch > 1 and a.short:
        n = a.short[0]
        prompts = [np.asarray(prompt(tok, model.cfg.vocab_size, n + 7 * i)[7 * i:], np.int32)
                   for i in range(a.batch)]
        e = eng["now"]
        slots = list(range(a.batch))

        def one_by_one():
            for s, ids in zip(slots, prompts):
                e.prefill(s, ids)
            jax.block_until_ready(e.logits)

        def together():
            e.prefill_batch(slots, prompts, [e.sampling[0]] * a.batch)
            jax.block_until_ready(e.logits)

        times = {"together_s": [], "one_by_one_s": []}
        for rep in range(a.repeats + 1):
            for way in ("together", "one_by_one")[::1 if rep % 2 else -1]:
                times[f"{way}_s"].append(timed(together if way == "together" else one_by_one))
        report(f"{a.batch} prompts of {n} tokens", times)


if __name__ == "__main__":
    main()
