"""Where the engine's decode step spends its time, by operation: a prompt
prefilled into `--width` slots of an engine of `--slots`, then `--steps` decode
steps traced with `jax.profiler` and the trace's XLA operations summed by name,
each FFI call named by its target in the compiled program (docs/log/serving.md,
"Runs 9 and 10": the weight products, the selection's and attention's kernels).
One JSON line: the steps' wall times untraced, and the --top operations' ms per
step.

    python benchmarks/decode_step_ops.py [--context 7200] [--slots 2] [--width 1]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import shutil
import tempfile
import time

# the compiled decode program's text, to name its FFI calls (set before jax loads)
DUMP = tempfile.mkdtemp(prefix="hisparse-hlo-")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                           " --xla_dump_hlo_module_re=jit__decode --xla_dump_hlo_pass_re=^$")

import jax
import numpy as np

from hisparse_jax.harness.generate_bench import prompt
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load


def ffi_targets() -> dict[str, str]:
    """FFI call name -> its target, from the dumped decode programs."""
    names = {}
    for f in pathlib.Path(DUMP).glob("*jit__decode*after_optimizations.txt"):
        for op, target in re.findall(r"(ffi_call[.\d]*) = .*?custom_call_target=\"([^\"]+)\"",
                                     f.read_text()):
            names[op] = target
    return names


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=7200)
    p.add_argument("--slots", type=int, default=2, help="the engine's sequence slots")
    p.add_argument("--width", type=int, default=1, help="slots decoding (prefilled alike)")
    p.add_argument("--budget-tokens", type=int, default=512, help="hisparse serve's at 8K")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    if not 1 <= a.width <= a.slots:
        p.error("--width must be 1..--slots")
    model, tok = load(a.model)
    ids = np.asarray(prompt(tok, model.cfg.vocab_size, a.context), np.int32)
    e = Engine(model, max_seqs=a.slots, max_context=a.context + 2 * a.steps + 64,
               budget_tokens=a.budget_tokens)
    for s in range(a.width):
        e.prefill(s, ids)
    active = np.arange(a.slots) < a.width
    for _ in range(4):  # compiles, warms
        e.decode_step(active)
    untraced = []
    for _ in range(a.steps):
        t = time.perf_counter()
        e.decode_step(active)
        untraced.append(time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(a.steps):
            e.decode_step(active)
        jax.profiler.stop_trace()
        [trace] = pathlib.Path(d).rglob("*.trace.json.gz")
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    names = ffi_targets()
    shutil.rmtree(DUMP, ignore_errors=True)
    ms, count = collections.Counter(), collections.Counter()
    for ev in events:  # XLA's operations carry their HLO op's name
        if ev.get("ph") == "X" and "hlo_op" in ev.get("args", {}):
            name = names.get(ev["name"], ev["name"])  # the same target's calls summed
            ms[name] += ev.get("dur", 0) / 1e3 / a.steps
            count[name] += 1
    print(json.dumps({"model": a.model, "context": a.context, "slots": a.slots,
                      "width": a.width, "budget_tokens": a.budget_tokens,
                      "step_ms_untraced": [round(1e3 * t, 1) for t in untraced],
                      "ops_ms_per_step": round(sum(ms.values()), 1),
                      "ops": [{"name": n, "ms": round(v, 2), "calls": count[n] // a.steps}
                              for n, v in ms.most_common(a.top)],
                      "load_avg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
