"""Time one layer of the exact causal prefill attention (`causal_prefill_attention`)
against variants of the same online softmax: key-block sizes, bf16 dot inputs with
float32 accumulation, smaller query blocks. The prefill-bound analysis in
docs/serving.md quotes its output.

    .venv/bin/python benchmarks/prefill_attention_variants.py   # 7,680 tokens, SmolLM2's heads
"""
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import causal_prefill_attention


def variant(q, k, v, *, chunk=512, kblock=128, dot_dtype=jnp.float32):
    t, hq, d = q.shape
    hkv = k.shape[1]; g = hq // hkv
    n = t // chunk; nk = chunk // kblock
    scale = 1.0 / math.sqrt(d)
    qc = (q.astype(jnp.float32) * scale).astype(dot_dtype).reshape(n, chunk, hkv, g, d)
    kc = k.astype(dot_dtype).reshape(n * nk, kblock, hkv, d)
    vc = v.astype(dot_dtype).reshape(n * nk, kblock, hkv, d)
    local_q = jnp.arange(chunk); local_k = jnp.arange(kblock)
    def one_query_chunk(i, qi):
        def body(j, carry):
            m, l, acc = carry
            s = jnp.einsum("qhgd,khd->hgqk", qi, kc[j], preferred_element_type=jnp.float32)
            causal = (j * kblock + local_k)[None, :] <= (i * chunk + local_q)[:, None]
            s = jnp.where(causal, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return (m_new, l * corr + jnp.sum(p, -1),
                    acc * corr[..., None] + jnp.einsum("hgqk,khd->hgqd", p.astype(dot_dtype), vc[j], preferred_element_type=jnp.float32))
        init = (jnp.full((hkv, g, chunk), -jnp.inf), jnp.zeros((hkv, g, chunk)), jnp.zeros((hkv, g, chunk, d)))
        _, l, acc = jax.lax.fori_loop(0, (i + 1) * nk, body, init)
        return (acc / l[..., None]).transpose(2, 0, 1, 3).reshape(chunk, hq, d)
    out = jax.lax.map(lambda a: one_query_chunk(*a), (jnp.arange(n), qc))
    return out.reshape(t, hq, d)

T = 7680
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((T, 9, 64)), jnp.float32)
k = jnp.asarray(rng.standard_normal((T, 3, 64)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((T, 3, 64)), jnp.bfloat16)
ref = None
for name, f in [("current", jax.jit(functools.partial(causal_prefill_attention, chunk=512))),
                ("kb512-f32", jax.jit(functools.partial(variant, kblock=512))),
                ("kb128-f32", jax.jit(functools.partial(variant, kblock=128))),
                ("kb64-f32", jax.jit(functools.partial(variant, kblock=64))),
                ("kb512-bf16", jax.jit(functools.partial(variant, kblock=512, dot_dtype=jnp.bfloat16))),
                ("kb128-bf16", jax.jit(functools.partial(variant, kblock=128, dot_dtype=jnp.bfloat16))),
                ("q128-kb128-f32", jax.jit(functools.partial(variant, chunk=128, kblock=128))),
                ]:
    o = f(q, k, v).block_until_ready()  # compile
    ts = []
    for _ in range(2):
        t0 = time.perf_counter()
        f(q, k, v).block_until_ready()
        ts.append(time.perf_counter() - t0)
    if ref is None:
        ref = np.asarray(o)
    diff = float(np.abs(np.asarray(o) - ref).max())
    print(f"{name} {min(ts):.3f} s/layer x30 = {30 * min(ts):.1f} s maxdiff {diff:.2e}",
          flush=True)
