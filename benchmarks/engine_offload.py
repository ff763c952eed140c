"""The serving engine's offload mode against all-resident, side by side in one run:
SmolLM2-135M, the same prompts in the same slots, greedy decode steps timed after
warm-up. One JSON row per engine: median step time, the tokens' equality with the
all-resident engine, and the offload counters (hit rate, pages and bytes copied).

    .venv/bin/python benchmarks/engine_offload.py [--prompt-tokens 1500] [--slots 4]
        [--active 2] [--budget-tokens 128] [--steps 40] [--programs]

--programs: then, for each offloaded engine, 10 more steps with every program of
the layer loop waited for and timed alone (`programs_ms_per_step`; the rest of
the step, `other_ms_per_step`, is Python and the host's own work). The waits
slow the step: its time is in `timed_step_ms`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import jax
import numpy as np

from hisparse_jax import offload, scheduler
from hisparse_jax.models import engine as engine_module
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load

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
    p.add_argument("--programs", action="store_true",
                   help="also time each program of an offloaded step alone")
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
            if args.programs:
                row.update(time_programs(eng, steps=10))
        print(json.dumps({**row, "command": command, "date": date}), flush=True)


PROGRAMS = ((engine_module, ("_offload_front", "_offload_back", "_logits_and_sample")),
            (offload, ("_fetch_pages", "_put_copies", "_store_pages")))


def time_programs(eng, steps: int) -> dict:
    """`steps` decode steps with each program of the offloaded layer loop waited for
    and timed alone: ms per step by program, and what is left of the step."""
    spent = dict.fromkeys((n for _, names in PROGRAMS for n in names), 0.0)
    saved = [(m, n, getattr(m, n)) for m, names in PROGRAMS for n in names]

    def timed(name, f):
        def run(*a, **k):
            t = time.perf_counter()
            out = jax.block_until_ready(f(*a, **k))
            spent[name] += time.perf_counter() - t
            return out
        return run

    for m, n, f in saved:
        setattr(m, n, timed(n, f))
    try:
        t = time.perf_counter()
        for _ in range(steps):
            eng.decode_step()
        total = time.perf_counter() - t
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    ms = lambda x: round(x / steps * 1e3, 2)
    return {"timed_step_ms": ms(total),
            "programs_ms_per_step": {n: ms(x) for n, x in spent.items()},
            "other_ms_per_step": ms(total - sum(spent.values()))}


if __name__ == "__main__":
    main()
