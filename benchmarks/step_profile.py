"""Where one HiSparse decode step's time goes on the XLA path (docs/log/results.md):
median of each part measured alone, random K/V (speed does not depend on content).

    python benchmarks/step_profile.py --context 131072 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import attention
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import preset
from pallas_kernels.lookup import reference as lookup_ref


def median_ms(fn, repeats):
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    ctx = -(-args.context // 16) * 16
    cfg = preset("default").replace(max_context=ctx, max_seqs=1, num_pool_pages=None)
    rng = np.random.default_rng(0)
    cache = HiSparseCache(cfg, implementation="xla")
    k = jnp.asarray(rng.standard_normal((ctx, cfg.num_kv_heads, cfg.head_dim), np.float32),
                    jnp.bfloat16)
    cache.prefill(0, k, k)
    st = cache.state
    q = jnp.asarray(rng.standard_normal((1, cfg.num_q_heads, cfg.head_dim), np.float32))
    sel = attention.select(cfg, st, q)
    scores = jax.jit(lookup_ref.page_scores)
    parts = {
        "page scores": lambda: scores(attention.group_queries(cfg, q), st.digest_center,
                                      st.digest_radius, st.page_table),
        f"selection of {cfg.candidate_pages} candidates (scores + top-k + side pages + dedupe)":
            lambda: attention.select_pages(cfg, st, q),
        "selection + tail sample": lambda: attention.select(cfg, st, q),
        f"attention: sink/hot/warm + {cfg.budget_pages} pages (no re-rank)":
            lambda: attention.attend_pages(cfg, st, q, sel.pages[..., :cfg.budget_pages]),
        f"attention: re-rank {cfg.candidate_pages} -> {cfg.budget_pages} pages "
        f"(+ {cfg.rerank_samples} rejected sampled)":
            lambda: attention.attend_pages(cfg, st, q, sel.pages),
        f"attention: re-rank + {cfg.tail_sample_pages} tail pages":
            lambda: attention.attend_pages(cfg, st, q, sel.pages, sel.sample, sel.sample_logw),
        "whole decode step": lambda: attention.decode_attention(cfg, st, q),
    }
    print(f"context {ctx}, batch 1, {cfg.num_kv_heads} KV heads, median of {args.repeats}")
    for name, fn in parts.items():
        print(f"  {name:70s} {median_ms(fn, args.repeats):7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
