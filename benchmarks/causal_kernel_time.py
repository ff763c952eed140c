"""Time the AMX causal-attention kernel (`cpu_kernels.ops.causal_attention`) on one
prefill block at SmolLM2's heads: 512 queries at the end of a 7,680-token prompt,
the served prefill's costliest block. One JSON line: wall and CPU time per call
(min and median of --repeats), and the largest error of every 16th query's output
against the same attention in float64. On a shared 2-core machine the minimum is the
figure to compare; compare two versions of the kernel by alternating checkouts:

    for rev in A B A B A B; do git checkout -q $rev -- cpu_kernels/causal_attention.cc
      .venv/bin/python benchmarks/causal_kernel_time.py --label $rev; done
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import ops


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=7680)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--label", default="")
    a = p.parse_args()
    rng = np.random.default_rng(0)
    hq, hkv, d = 9, 3, 64
    q = jnp.asarray(rng.standard_normal((a.block, hq, d)) * 2, jnp.float32)
    k = jnp.asarray(rng.standard_normal((a.tokens, hkv, d)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((a.tokens, hkv, d)), jnp.bfloat16)
    start = a.tokens - a.block
    f = jax.jit(ops.causal_attention)
    f(q, k, v, start).block_until_ready()
    wall, cpu = [], []
    for _ in range(a.repeats):
        c, t = time.process_time(), time.perf_counter()
        f(q, k, v, start).block_until_ready()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    out = np.asarray(f(q, k, v, start))
    kf, vf, qf = (np.asarray(x, np.float64) for x in (k, v, q))
    err = 0.0
    for i in range(0, a.block, 16):
        for h in range(hq):
            s = kf[:start + i + 1, h // (hq // hkv)] @ qf[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            ref = p @ vf[:start + i + 1, h // (hq // hkv)] / p.sum()
            err = max(err, float(np.abs(out[i, h] - ref).max()))
    ms = lambda xs: [round(min(xs) * 1e3, 1), round(float(np.median(xs)) * 1e3, 1)]
    print(json.dumps({"label": a.label, "tokens": a.tokens, "block": a.block,
                      "wall_ms_min_median": ms(wall), "cpu_ms_min_median": ms(cpu),
                      "max_err_float64": err,
                      "load_avg_1m": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
