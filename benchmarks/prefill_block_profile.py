"""Where one block of a served prompt's prefill spends its time: a prompt
prefilled block by block as `hisparse serve` does (`Engine.prefill_chunk`, 8 slots
of 8,192 tokens), then the block at --start run again under `jax.profiler` and
the trace's XLA operations summed by name (docs/log/results.md, "AMX prefill
attention": the kernel, the weight products, and the copies XLA makes per layer).
One JSON line: the block's wall time untraced and traced, and the --top
operations' total ms and counts.

    python benchmarks/prefill_block_profile.py [--tokens 7800] [--start 7168]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import tempfile
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
    p.add_argument("--start", type=int, default=7168, help="the block to profile (a multiple "
                   f"of {PREFILL_CHUNK} below --tokens)")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    if a.start % PREFILL_CHUNK or not 0 <= a.start < a.tokens:
        p.error(f"--start must be a multiple of {PREFILL_CHUNK} below --tokens")
    model, tok = load(a.model)
    ids = np.asarray(prompt(tok, model.cfg.vocab_size, a.tokens), np.int32)
    e = Engine(model, max_seqs=8, max_context=8192, budget_tokens=512)

    def upto_block():  # the blocks before --start, then the time of that one
        for s in range(0, a.start, PREFILL_CHUNK):
            e.prefill_chunk(0, ids, s)
        jax.block_until_ready(e.logits)
        t = time.perf_counter()
        e.prefill_chunk(0, ids, a.start)
        jax.block_until_ready(e.logits)
        return time.perf_counter() - t

    upto_block()  # compiles
    untraced = upto_block()
    with tempfile.TemporaryDirectory() as d:
        for s in range(0, a.start, PREFILL_CHUNK):
            e.prefill_chunk(0, ids, s)
        jax.block_until_ready(e.logits)
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t = time.perf_counter()
        e.prefill_chunk(0, ids, a.start)
        jax.block_until_ready(e.logits)
        traced = time.perf_counter() - t
        jax.profiler.stop_trace()
        [trace] = pathlib.Path(d).rglob("*.trace.json.gz")
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    ms, count = collections.Counter(), collections.Counter()
    for ev in events:  # XLA's operations carry their HLO op's name
        if ev.get("ph") == "X" and "hlo_op" in ev.get("args", {}):
            ms[ev["name"]] += ev.get("dur", 0) / 1e3
            count[ev["name"]] += 1
    print(json.dumps({"model": a.model, "tokens": a.tokens, "start": a.start,
                      "prefill": e.prefill_implementation, "block_s": round(untraced, 3),
                      "traced_s": round(traced, 3),
                      "ops": [{"name": n, "ms": round(v, 1), "count": count[n]}
                              for n, v in ms.most_common(a.top)]}))


if __name__ == "__main__":
    main()
