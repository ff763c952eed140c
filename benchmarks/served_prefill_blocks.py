"""Where a served prompt's prefill time goes: one prompt through the engine's
chunked prefill (`Engine.prefill_chunk`, as `hisparse serve` runs it), each
512-token block timed, the last one including the fill of the HiSparse cache from
the staged K/V. Engine as the server makes it (8 slots of 8,192 tokens, budget
512); one warm-up prompt, then --repeats timed ones. One JSON line per prompt.

    python benchmarks/served_prefill_blocks.py --tokens 7800
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.harness.generate_bench import prompt
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=7800)
    p.add_argument("--attention", default="hisparse", choices=["hisparse", "dense"])
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    model, tok = load(a.model)
    ids = np.asarray(prompt(tok, model.cfg.vocab_size, a.tokens), np.int32)
    e = Engine(model, max_seqs=8, max_context=8192, attention=a.attention, budget_tokens=512)
    e.warmup(len(ids))
    for rep in range(a.repeats + 1):
        blocks = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            t = time.perf_counter()
            e.prefill_chunk(0, ids, start)
            jax.block_until_ready(e.logits)
            blocks.append(round(time.perf_counter() - t, 3))
        if rep:
            print(json.dumps({"model": a.model, "attention": a.attention, "tokens": len(ids),
                              "prefill": e.prefill_implementation, "total_s": round(sum(blocks), 2),
                              "block_s": blocks}), flush=True)


if __name__ == "__main__":
    main()
