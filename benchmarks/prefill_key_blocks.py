"""What one query block of the exact prefill attention costs on this CPU, by key
block size and by the queries' precision (docs/log/serving.md, "Measured"): one
512-query block of SmolLM2's shape (3 KV heads, 3 query heads each, head_dim 64,
float32 queries, bf16 keys and values as the staged K/V) over --keys keys, in
the online softmax of `attention.causal_query_block`, timed for key blocks of
512, 256, 128 and 64, with float32 queries (today's exact prefill) and bf16 ones.
Then the same block on the AMX kernel (`cpu_kernels/causal_attention.cc`, where
the CPU has AMX-BF16), as the last 512 queries of a prompt of --keys tokens.
Prints one JSON line per variant: median ms over --repeats, and the largest
difference from the float32 512-key-block output.

    python benchmarks/prefill_key_blocks.py --keys 4096
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build
from cpu_kernels import ops as cpu_ops

QUERIES, GROUP, KV_HEADS, HEAD_DIM = 512, 3, 3, 64


def block_attention(key_block: int, bf16_queries: bool, keys: int):
    def run(q, k, v):
        def step(carry, j):
            m, l, acc = carry
            kj = jax.lax.dynamic_slice_in_dim(k, j * key_block, key_block, 1)
            vj = jax.lax.dynamic_slice_in_dim(v, j * key_block, key_block, 1)
            if bf16_queries:
                s = jnp.einsum("hqd,hkd->hqk", q.astype(jnp.bfloat16), kj,
                               preferred_element_type=jnp.float32)
            else:
                s = jnp.einsum("hqd,hkd->hqk", q, kj.astype(jnp.float32))
            m_new = jnp.maximum(m, jnp.max(s, -1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("hqk,hkd->hqd", p, vj.astype(jnp.float32))
            return (m_new, l * corr + jnp.sum(p, -1), acc * corr[..., None] + pv), None

        init = (jnp.full(q.shape[:2], -jnp.inf), jnp.zeros(q.shape[:2]), jnp.zeros(q.shape))
        (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(keys // key_block))
        return acc / l[..., None]
    return jax.jit(run)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=4096, help="a multiple of 512")
    p.add_argument("--repeats", type=int, default=8)
    a = p.parse_args(argv)
    if a.keys <= 0 or a.keys % 512:
        p.error(f"--keys {a.keys}: a positive multiple of 512")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((KV_HEADS, GROUP * QUERIES, HEAD_DIM)), jnp.float32) * 0.3
    k, v = (jnp.asarray(rng.standard_normal((KV_HEADS, a.keys, HEAD_DIM)), jnp.bfloat16)
            for _ in range(2))
    ref = None
    for key_block in (512, 256, 128, 64):
        for bf16 in (False, True):
            fn = block_attention(key_block, bf16, a.keys)
            out = np.asarray(fn(q, k, v))
            ref = out if ref is None else ref
            ts = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                fn(q, k, v).block_until_ready()
                ts.append(time.perf_counter() - t)
            print(json.dumps({"keys": a.keys, "key_block": key_block, "bf16_queries": bf16,
                              "ms": round(1e3 * float(np.median(ts)), 1),
                              "max_diff": float(np.abs(out - ref).max())}), flush=True)
    if build.amx_unavailable():
        print(json.dumps({"amx_kernel": build.amx_unavailable()}))
        return
    # [Hkv, G*C, D] rows -> [C, Hq, D] queries; keys [S, Hkv, D]; the queries come scaled
    qt = q.reshape(KV_HEADS, GROUP, QUERIES, HEAD_DIM).transpose(2, 0, 1, 3).reshape(
        QUERIES, KV_HEADS * GROUP, HEAD_DIM)
    kt, vt = (x.transpose(1, 0, 2) for x in (k, v))
    fn = jax.jit(lambda q, k, v: cpu_ops.causal_attention(q, k, v, a.keys - QUERIES,
                                                          sm_scale=1.0))
    got = np.asarray(fn(qt, kt, vt)).reshape(QUERIES, KV_HEADS, GROUP, HEAD_DIM)
    ts = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        fn(qt, kt, vt).block_until_ready()
        ts.append(time.perf_counter() - t)
    # the XLA blocks attend every key; the kernel's last queries too, its first ones
    # fewer (causal): compare the last query, which sees all
    want = ref.reshape(KV_HEADS, GROUP, QUERIES, HEAD_DIM)[:, :, -1]
    print(json.dumps({"keys": a.keys, "amx_kernel": True, "causal": True,
                      "ms": round(1e3 * float(np.median(ts)), 1),
                      "max_diff_last_query": float(np.abs(got[-1] - want).max())}), flush=True)


if __name__ == "__main__":
    main()
