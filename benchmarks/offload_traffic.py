"""Host->device traffic of a live offloaded cache during decode (docs/log/scheduler.md):
pages fetched for the selection and pages copied for the tail sample, per step
and KV head, with and without the sample.

    python benchmarks/offload_traffic.py --context 32768 --steps 96 --step-noise 0.15

The queries glide between anchor queries of a generated workload (as the
scheduler bench's drift trace) with per-step jitter; one token is appended per
step, so the context grows and pages turn cold as in real decode.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import preset
from hisparse_jax.harness.workloads import make_workload
from hisparse_jax.offload.store import OffloadedCache


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--segment", type=int, default=32, help="steps between anchor queries")
    p.add_argument("--step-noise", type=float, default=0.15, help="jitter x the query norm")
    p.add_argument("--tail-samples", type=int, nargs="+", default=[32, 0])
    p.add_argument("--sticky-nats", type=float, nargs="+", default=[None],
                   help="selection stickiness to compare (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    s, steps, seg = args.context, args.steps, args.segment
    wl = make_workload(context=s + steps, num_kv_heads=4, num_queries=steps // seg + 2,
                       seed=args.seed)
    t = np.arange(steps)
    a, frac = t // seg, (t % seg) / seg
    q = (1 - frac)[:, None, None] * wl.q[a] + frac[:, None, None] * wl.q[a + 1]
    norm = np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(q.shape[-1])
    rng = np.random.default_rng(args.seed + 1000)
    q = (q + args.step_noise * norm * rng.standard_normal(q.shape)).astype(np.float32)
    for n, sticky in ((n, x) for x in args.sticky_nats for n in args.tail_samples):
        cfg = preset("default").replace(num_kv_heads=4, max_context=-(-(s + steps) // 16) * 16,
                                        tail_sample_pages=n)
        if sticky is not None:
            cfg = cfg.replace(sticky_nats=sticky)
        cache = HiSparseCache(cfg)
        cache.prefill(0, wl.k[:s], wl.v[:s])
        off = OffloadedCache(cache)
        prev, overlap = None, []
        for i in range(steps):
            off.append(wl.k[s + i][None], wl.v[s + i][None])
            _, sel = off.attend(q[i][None], return_selection=True)
            sel = np.asarray(sel)[0]
            if prev is not None:
                overlap.append(np.mean([np.isin(sel[h], prev[h]).mean() for h in range(4)]))
            prev = sel
        c = off.counters()
        per = steps * cfg.num_kv_heads
        print(json.dumps({
            "context": s, "steps": steps, "step_noise": args.step_noise,
            "tail_sample_pages": n, "sticky_nats": cfg.sticky_nats,
            "overlap_consecutive_steps": round(float(np.mean(overlap)), 3),
            "hit_rate": round(c["hit_rate"], 3),
            "selection_pages_fetched_per_step_head": round(c["fetched"] / per, 2),
            "sample_pages_copied_per_step_head": round(c["sample_pages_copied"] / per, 2),
            "kib_per_step": round(c["host_to_device_bytes_copied"] / steps / 1024, 1)}),
            flush=True)


if __name__ == "__main__":
    main()
