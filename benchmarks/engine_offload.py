"""The serving engine's offload mode against all-resident, side by side in one run:
SmolLM2-135M, the same prompts in the same slots, greedy decode steps timed after
warm-up. One JSON row per engine: median step time, the tokens' equality with the
all-resident engine, and the offload counters (hit rate, pages and bytes copied).

    .venv/bin/python benchmarks/engine_offload.py [--prompt-tokens 1500] [--slots 4]
        [--active 2] [--budget-tokens 128] [--steps 40]

An offloaded step is one program (`kv.decode` of `OffloadedKV`) since 2026-12-06;
rows before that date timed one with two programs and a host sync per layer
(their `programs_ms_per_step` came from a `--programs` option that timed each).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import numpy as np

from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load
from hisparse_jax.offload import policy as scheduler

TEXT = ("The lighthouse keeper wrote down the weather, the ships that passed and the birds "
        "he saw each morning; on the last page of the third book he noted where the key "
        "to the blue door was hidden, and who had asked him about it. ")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--active", type=int, default=2)
    p.add_argument("--budget-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    model, tok = load("smollm2-135m")
    ids = np.asarray(tok.encode(TEXT * (args.prompt_tokens // 40 + 1))[:args.prompt_tokens],
                     np.int32)
    context = -(-(args.prompt_tokens + args.steps + 1) // 512) * 512
    ref = None
    command = " ".join(["python", "benchmarks/engine_offload.py", *sys.argv[1:]])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    for name, kw in (("resident", {}), ("offload-predictive", {"offload": True}),
                     ("offload-lru", {"offload": True, "policy": scheduler.LRU})):
        eng = Engine(model, max_seqs=args.slots, max_context=context,
                     budget_tokens=args.budget_tokens, **kw)
        eng.warmup(args.prompt_tokens)
        for slot in range(args.active):  # each slot a different length
            eng.prefill(slot, ids[:args.prompt_tokens - 100 * slot])
        times, toks = [], []
        for _ in range(args.steps):
            t = time.perf_counter()
            toks.append(eng.decode_step())
            times.append(time.perf_counter() - t)
        toks = np.asarray(toks)
        ref = toks if ref is None else ref
        row = {"engine": name, "slots": args.slots, "active": args.active,
               "prompt_tokens": args.prompt_tokens, "budget_tokens": args.budget_tokens,
               "steps": args.steps, "median_step_s": round(float(np.median(times[5:])), 4),
               "tokens_equal_resident": bool((toks == ref).all())}
        if eng.offload:
            c = eng.offload_counters()
            row.update({k: c[k] for k in ("selected", "hits", "misses", "prefetched",
                                          "sample_pages_copied")})
            row["hit_rate"] = round(c["hit_rate"], 4)
            row["h2d_kib_per_step"] = round(c["host_to_device_bytes_copied"] / args.steps
                                            / 1024, 1)
        print(json.dumps({**row, "command": command, "date": date}), flush=True)


if __name__ == "__main__":
    main()
