"""Time one layer of the exact causal prefill attention (`causal_prefill_attention`)
against variants of the same online softmax, interleaved, in one run: the layout
it had before (query blocks [C, Hkv, G, D], so that each block's matmuls
transposed their operands), the diagonal key block alone masked, bf16 dot inputs
with float32 accumulation, and other block sizes.
docs/log/serving.md quotes its output.

    .venv/bin/python benchmarks/prefill_attention_variants.py   # 7,680 tokens, SmolLM2's heads
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/prefill_attention_variants.py --model-kl 4096

`--model-kl N`: what bf16 dot inputs would cost in quality instead: SmolLM2 on
the first N tokens of each next-token document (`model_quality.DOCS`), the
logits of positions N/2..N-1 with the bf16 variant as the model's prefill
attention against the float32 one (top-1 agreement, mean and max KL).
"""
import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import causal_prefill_attention


def old_layout(q, k, v, *, chunk=512):
    """`causal_prefill_attention` as it was before its rows became [Hkv, G*C, D]."""
    t, hq, d = q.shape
    hkv = k.shape[1]; g = hq // hkv; n = t // chunk
    scale = 1.0 / math.sqrt(d)
    qc = q.astype(jnp.float32).reshape(n, chunk, hkv, g, d)
    kc = k.astype(jnp.float32).reshape(n, chunk, hkv, d)
    vc = v.astype(jnp.float32).reshape(n, chunk, hkv, d)
    local = jnp.arange(chunk)

    def one_query_chunk(i, qi):
        def body(j, carry):
            m, l, acc = carry
            s = jnp.einsum("qhgd,khd->hgqk", qi, kc[j]) * scale
            causal = (j * chunk + local)[None, :] <= (i * chunk + local)[:, None]
            s = jnp.where(causal, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return (m_new, l * corr + jnp.sum(p, -1),
                    acc * corr[..., None] + jnp.einsum("hgqk,khd->hgqd", p, vc[j]))
        init = (jnp.full((hkv, g, chunk), -jnp.inf), jnp.zeros((hkv, g, chunk)),
                jnp.zeros((hkv, g, chunk, d)))
        _, l, acc = jax.lax.fori_loop(0, i + 1, body, init)
        return (acc / l[..., None]).transpose(2, 0, 1, 3).reshape(chunk, hq, d)
    return jax.lax.map(lambda a: one_query_chunk(*a), (jnp.arange(n), qc)).reshape(t, hq, d)


def variant(q, k, v, *, chunk=512, mask_all=True, dot_dtype=jnp.float32):
    """Today's layout (rows [Hkv, G*C, D]): the diagonal block alone masked, bf16
    dots, other block sizes."""
    t, hq, d = q.shape
    hkv = k.shape[1]; g = hq // hkv; n = t // chunk
    scale = 1.0 / math.sqrt(d)
    qb = (q.astype(jnp.float32) * scale).reshape(n, chunk, hkv, g, d).transpose(0, 2, 3, 1, 4)
    qb = qb.reshape(n, hkv, g * chunk, d).astype(dot_dtype)
    kc, vc = (x.astype(dot_dtype).reshape(n, chunk, hkv, d).transpose(0, 2, 1, 3) for x in (k, v))
    qpos = jnp.tile(jnp.arange(chunk), g)

    def one(i, qi):
        def step(c, j, masked):
            m, l, acc = c
            s = jnp.einsum("hqd,hkd->hqk", qi, kc[j], preferred_element_type=jnp.float32)
            if masked:
                s = jnp.where((j * chunk + jnp.arange(chunk))[None, :] <= (i * chunk + qpos)[:, None],
                              s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            return (m_new, l * corr + jnp.sum(p, -1), acc * corr[..., None] + jnp.einsum(
                "hqk,hkd->hqd", p.astype(dot_dtype), vc[j], preferred_element_type=jnp.float32))
        c = (jnp.full((hkv, g * chunk), -jnp.inf), jnp.zeros((hkv, g * chunk)),
             jnp.zeros((hkv, g * chunk, d)))
        if mask_all:
            _, l, acc = jax.lax.fori_loop(0, i + 1, lambda j, c: step(c, j, True), c)
        else:
            c = jax.lax.fori_loop(0, i, lambda j, c: step(c, j, False), c)
            _, l, acc = step(c, i, True)
        return (acc / l[..., None]).reshape(hkv, g, chunk, d).transpose(2, 0, 1, 3).reshape(chunk, hq, d)
    return jax.lax.map(lambda a: one(*a), (jnp.arange(n), qb)).reshape(t, hq, d)


def model_kl(tokens: int):
    """`--model-kl`: bf16 dot inputs against float32 through the whole model."""
    from model_quality import DOCS, _open_doc, exact_logprobs

    from hisparse_jax import attention as att
    from hisparse_jax.models.registry import load
    model, tok = load("smollm2-135m")
    bf16 = functools.partial(variant, mask_all=False, dot_dtype=jnp.bfloat16)
    exact = att.causal_prefill_attention
    for name, path, _ in DOCS:
        with _open_doc(path) as f:
            ids = np.asarray(tok.encode(f.read())[:tokens], np.int32)
        ref = exact_logprobs(model, ids, tokens // 2)
        att.causal_prefill_attention = lambda q, k, v, chunk: bf16(q, k, v, chunk=chunk)
        try:
            got = exact_logprobs(model, ids, tokens // 2)
        finally:
            att.causal_prefill_attention = exact
        kl = (np.exp(ref) * (ref - got)).sum(-1)
        print(f"{name:13s} positions {len(kl)}  top-1 {(ref.argmax(-1) == got.argmax(-1)).mean():.4f}"
              f"  mean KL {kl.mean():.2e}  max KL {kl.max():.2e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=7680, help="prompt length (a multiple of 512)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-kl", type=int, default=None, metavar="N",
                    help="bf16 dots' quality cost through SmolLM2 on N-token documents")
    args = ap.parse_args()
    if args.model_kl:
        return model_kl(args.model_kl)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((args.tokens, 9, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((args.tokens, 3, 64)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((args.tokens, 3, 64)), jnp.bfloat16)
    fs = {"current": functools.partial(causal_prefill_attention, chunk=512),
          "old-layout": old_layout,
          "mask-diagonal": functools.partial(variant, mask_all=False),
          "bf16-dots": functools.partial(variant, dot_dtype=jnp.bfloat16),
          "blocks-256": functools.partial(variant, chunk=256),
          "blocks-128": functools.partial(variant, chunk=128)}
    fs = {name: jax.jit(f) for name, f in fs.items()}
    outs = {name: np.asarray(f(q, k, v).block_until_ready()) for name, f in fs.items()}  # compile
    times = {name: [] for name in fs}
    for _ in range(args.repeats):  # interleaved: this machine's load drifts
        for name, f in fs.items():
            t0 = time.perf_counter()
            f(q, k, v).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    base = min(times["current"])
    for name in fs:
        t = min(times[name])
        diff = float(np.abs(outs[name] - outs["current"]).max())
        print(f"{name:17s} {t:.3f} s/layer x30 = {30 * t:5.1f} s  {t / base:.2f}x current"
              f"  maxdiff {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
