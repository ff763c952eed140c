"""Side-by-side speed of HiSparse vs dense decode attention on the XLA path.

Both run in one process on the same data, compile and warm-up excluded, median of
several calls: the ratio is what to trust on a noisy machine.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import decode_attention, dense_decode_attention
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import preset
from hisparse_jax.validate import check_int


def _time_interleaved(fns, repeats):
    """Median ms of each fn, calls alternated so every fn sees the same machine load."""
    for fn in fns:  # compile + warm-up
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append((time.perf_counter() - t0) * 1e3)
    return [(statistics.median(ts), ts) for ts in times]


def random_decode_case(cfg, context: int, *, seed: int = 0):
    """Random bf16 K/V of `context` tokens in every one of cfg.max_seqs slots (XLA
    path): (the filled cache's state, q [B, Hq, D], dense() -> exact attention over
    the same K/V in a dense bf16 cache). Speed does not depend on content:
    selection always reads every digest and the budget's pages."""
    batch, h, d = cfg.max_seqs, cfg.num_kv_heads, cfg.head_dim
    rng = np.random.default_rng(seed)
    cache = HiSparseCache(cfg, implementation="xla")
    k_all = jnp.asarray(rng.standard_normal((batch, context, h, d), np.float32), jnp.bfloat16)
    v_all = jnp.asarray(rng.standard_normal((batch, context, h, d), np.float32), jnp.bfloat16)
    for b in range(batch):
        cache.prefill(b, k_all[b], v_all[b])
    q = jnp.asarray(rng.standard_normal((batch, cfg.num_q_heads, d), np.float32))
    k_dense = k_all.transpose(0, 2, 1, 3)  # [B, Hkv, S, D] bf16: a dense bf16 cache
    v_dense = v_all.transpose(0, 2, 1, 3)
    lengths = jnp.full((batch,), context, jnp.int32)
    return cache.state, q, lambda: dense_decode_attention(q, k_dense, v_dense, lengths)


def bench_attention(context: int, *, preset_name: str = "default", batch: int = 1,
                    repeats: int = 7, seed: int = 0, tail_sample_pages: int | None = None,
                    rerank_multiple: float | None = None, log=None) -> dict:
    """Decode attention at `context` tokens: HiSparse (cache already filled) vs dense
    bf16 attention over the same K/V, calls interleaved. Random K/V: speed does not
    depend on content (selection always reads every digest and `budget` pages)."""
    log = log or (lambda *_: None)
    context = check_int("context", context, minimum=1)
    check_int("repeats", repeats, minimum=1)
    base = preset(preset_name)
    pg = base.page_size
    ctx = -(-context // pg) * pg
    cfg = base.replace(max_context=ctx, max_seqs=batch, num_pool_pages=None)
    if tail_sample_pages is not None:
        cfg = cfg.replace(tail_sample_pages=tail_sample_pages)
    if rerank_multiple is not None:
        cfg = cfg.replace(rerank_multiple=rerank_multiple)
    log(f"building a {context}-token cache ({batch} x {cfg.num_kv_heads} KV heads, "
        f"head_dim {cfg.head_dim}) ...")
    state, q, dense = random_decode_case(cfg, context, seed=seed)

    log(f"timing dense and hisparse, {repeats} interleaved calls each ...")
    (dense_ms, dense_all), (sparse_ms, sparse_all) = _time_interleaved(
        [dense, lambda: decode_attention(cfg, state, q, implementation="xla")], repeats)
    return {
        "case": f"decode_{context}_b{batch}", "context": context, "batch": batch,
        "preset": preset_name, "tail_sample_pages": cfg.tail_sample_pages,
        "rerank_multiple": cfg.rerank_multiple,
        "implementation": "xla", "backend": jax.default_backend(),
        "dense_ms": dense_ms, "hisparse_ms": sparse_ms, "speedup": dense_ms / sparse_ms,
        "dense_ms_all": dense_all, "hisparse_ms_all": sparse_all,
        "command": f"hisparse bench attention --context {context} --batch {batch} "
                   f"--repeats {repeats} --preset {preset_name} "
                   f"--tail-sample-pages {cfg.tail_sample_pages} "
                   f"--rerank-multiple {cfg.rerank_multiple}",
    }
