"""A prompt's prefill through the serving engine, as `hisparse serve` runs it, at
prompt lengths that are not whole blocks: short prompts (`Engine.prefill`, one
program) and long ones block by block (`Engine.prefill_chunk`). Engine as the
server makes it (8 slots of 8,192 tokens, budget 512). One JSON line: seconds per
prompt, the median of --repeats after a warm-up. To compare two versions, run it
alternately from each checkout (PYTHONPATH=OTHER_CHECKOUT for the other):

    python benchmarks/prefill_lengths.py --label after
    PYTHONPATH=BEFORE python benchmarks/prefill_lengths.py --label before
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from hisparse_jax.models.bench import prompt
from hisparse_jax.models.engine import PREFILL_CHUNK, Engine
from hisparse_jax.models.registry import load


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--short", type=int, nargs="*", default=[40, 100])
    p.add_argument("--long", type=int, nargs="*", default=[1075, 4219, 7870])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--label", default="")
    a = p.parse_args(argv)
    model, tok = load(a.model)
    e = Engine(model, max_seqs=8, max_context=8192, attention="hisparse", budget_tokens=512)
    out = {"label": a.label, "model": a.model}
    for n in a.short + a.long:
        ids = np.asarray(prompt(tok, model.cfg.vocab_size, n), np.int32)
        ts = []
        for rep in range(a.repeats + 1):  # the first compiles
            t = time.perf_counter()
            if n <= PREFILL_CHUNK:
                e.prefill(rep % 8, ids)
            else:
                for start in range(0, n, PREFILL_CHUNK):
                    e.prefill_chunk(rep % 8, ids, start)
            jax.block_until_ready(e.logits)
            ts.append(time.perf_counter() - t)
        out[str(n)] = round(float(np.median(ts[1:])), 4)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
