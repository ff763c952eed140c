"""Is a sequence's decode step bit-equal at every decode width of an engine?

A decode step computes the slots up to the highest active one, rounded up to a
width (`Engine.decode_widths`: 1, 2, 4, 8, ..., max_seqs). The server's promise
that a greedy request gets what it gets served alone rests on slot 0's numbers
not depending on that width. XLA:CPU sums a row in an order that depends on
the number of rows and, once a reduction passes ~4,096 elements, on its size
(docs/log/serving.md, "Decode width"), so a reduction that grows with the batch
can break it at shapes the tests do not build. This runs one engine per
width, slot 0 holding the same prompt (the GPL's text) and the other slots
shorter ones, and prints slot 0's token and the largest logit difference from
the narrowest width at each step:

    python benchmarks/decode_width_check.py --max-seqs 32 --tokens 3000 --budget 512
    python benchmarks/decode_width_check.py --max-seqs 20 --tokens 5000 --budget 2048

Exits 1 if any width differs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from hisparse_jax.models.engine import Engine
from hisparse_jax.models.registry import load

TEXT = "/usr/share/common-licenses/GPL-3"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=3000, help="slot 0's prompt length")
    p.add_argument("--budget", type=int, default=512, help="decode budget (tokens)")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    model, tok = load(args.model)
    with open(TEXT) as f:
        ids = tok.encode(f.read())
    if len(ids) < args.tokens + 1000 + 20 * args.max_seqs:
        raise SystemExit(f"--tokens {args.tokens}: the text has {len(ids)} tokens")
    kw = {"max_seqs": args.max_seqs, "max_context": args.max_context,
          "budget_tokens": args.budget}
    engines = {}
    for w in Engine(model, **kw).decode_widths():
        e = Engine(model, **kw)
        e.prefill(0, ids[:args.tokens])
        for b in range(1, w):  # other lengths, other text
            start = args.tokens + 7 * b
            e.prefill(b, ids[start:start + 200 + 13 * b])
        engines[w] = e
        print(f"width {w}: {w} slots prefilled", flush=True)
    narrowest, same = min(engines), True
    for step in range(args.steps):
        out = {}
        for w, e in engines.items():
            e.decode_step(np.arange(args.max_seqs) < w)
            out[w] = (int(e.tokens[0]), np.asarray(e.logits)[0])
        ref = out[narrowest][1]
        diffs = {w: float(np.abs(lg - ref).max()) for w, (_, lg) in out.items()}
        same &= all(d == 0 for d in diffs.values())
        same &= len({t for t, _ in out.values()}) == 1
        print(f"step {step}: slot 0 tokens {[t for t, _ in out.values()]}, "
              f"max |logit - width {narrowest}'s| {diffs}", flush=True)
    print("bit-equal at every width" if same else "DIFFERS between widths")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
