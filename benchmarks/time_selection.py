"""Decode-step time of today's selection against another attention module's, as
`hisparse bench attention` times it (random K/V, default preset, each step right
after a dense call), all calls interleaved in one process:

    git show HEAD:hisparse_jax/attention/selection.py > attention_before.py
    python benchmarks/time_selection.py --context 131072 --repeats 15 --baseline attention_before.py

--baseline is a copy of hisparse_jax/attention/selection.py from before a change; without it,
peak_pages=0 (the sharp-head candidates off) stands in for it. --before-set gives
the before step its own config fields (a changed default, e.g. rerank_multiple=1.25).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np

from hisparse_jax import attention
from hisparse_jax.config import preset
from hisparse_jax.harness.attention_bench import _time_interleaved, random_decode_case

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharp_heads import config_overrides


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--baseline", help="path of an older attention.py")
    p.add_argument("--before-set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="config fields of the before step only")
    args = p.parse_args(argv)
    cfg = preset("default").replace(max_context=args.context, max_seqs=1, num_pool_pages=None)
    st, q, dense = random_decode_case(cfg, args.context)
    if args.baseline:
        spec = importlib.util.spec_from_file_location("attention_baseline", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        old = cfg.replace(**config_overrides(args.before_set))
        before = lambda: base.decode_attention(old, st, q, implementation="xla")
    else:
        off = cfg.replace(peak_pages=0, **config_overrides(args.before_set))
        before = lambda: attention.decode_attention(off, st, q, implementation="xla")
    fns = [dense, before, dense, lambda: attention.decode_attention(cfg, st, q,
                                                                    implementation="xla")]
    times = [ms for ms, _ in _time_interleaved(fns, args.repeats)]
    dense_ms = float(np.median([times[0], times[2]]))
    print(json.dumps({"context": args.context, "dense_ms": round(dense_ms, 2),
                      "before_ms": round(times[1], 2), "after_ms": round(times[3], 2),
                      "speedup_before": round(dense_ms / times[1], 2),
                      "speedup_after": round(dense_ms / times[3], 2),
                      **({"before_set": args.before_set} if args.before_set else {})}))


if __name__ == "__main__":
    main()
