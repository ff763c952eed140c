"""Capture a real model's decode attention (SmolLM2-135M, dense, exact) into
`hisparse eval --qkv` files, find its sharp heads and compare selections on them
(issue 14): HiSparse's attended pages against plain Quest's and the oracle's at
the same budget (`sharp_heads.compare`).

    python benchmarks/capture_heads.py                                  # passkey + GPL-3, all layers
    python benchmarks/capture_heads.py --prompts passkey --depth 0.1 --save-dir heads/
    python benchmarks/capture_heads.py --layers 5 12 --queries 16 --tokens 8000

Each prompt (about --tokens tokens) runs through the model once, with exact
causal attention over bf16 K/V (as the engine's prefill). For every layer the
queries of the last --queries positions and the K/V of the tokens before them
are kept, post-RoPE, as the cache sees them: q [N, Hq, D], k, v [S, Hkv, D]
float16 with S = prompt length - N (the format `hisparse eval --qkv` reads).
A head is sharp for a query when one cold page holds more than --sharp-mass of
its exact attention. Prompts: "passkey" (the long-context task of
`hisparse_jax.models.prompts`: a 5-digit key at --depth of a filler text, then
the question; here the filler sentences of a block are joined by spaces, not
newlines) and "gpl3" (/usr/share/common-licenses/GPL-3, repeated to
length, then a question about it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sharp_heads import compare, config_overrides, summarize

from hisparse_jax.attention import causal_prefill_attention
from hisparse_jax.config import PRESETS, preset
from hisparse_jax.harness.evaluation import config_for
from hisparse_jax.models.prompts import FILLER, INTRO, QUESTION, needle

CHUNK = 512
GPL = "/usr/share/common-licenses/GPL-3"


def passkey_prompt(tok, tokens: int, depth: float, key: int) -> tuple[list[int], str]:
    """The passkey prompt of about `tokens` tokens, the key at `depth` (0..1) of
    the filler: newline-joined intro, filler, key sentence, filler, question."""
    key_line = needle(key)
    base = len(tok.encode(f"{INTRO}\n{key_line}\n{QUESTION}"))
    per = len(tok.encode(" " + FILLER))
    n = max(2, (tokens - base) // per)
    before = round(n * depth)
    text = "\n".join([INTRO, " ".join([FILLER] * before), key_line,
                      " ".join([FILLER] * (n - before)), QUESTION])
    return tok.encode(text, add_bos=False), f"passkey depth {depth} key {key}"


def gpl_prompt(tok, tokens: int) -> tuple[list[int], str]:
    """GPL-3's text (repeated if short), cut to about `tokens` tokens, then a question."""
    text = pathlib.Path(GPL).read_text()
    ids = tok.encode(text, add_bos=False)
    q = tok.encode("\n\nQuestion: what does the license say about the source code? Answer:",
                   add_bos=False)
    body = (ids * (1 + tokens // max(1, len(ids))))[:tokens - len(q)]
    return body + q, "GPL-3"


def capture(model, ids: list[int], n_queries: int):
    """Run the prompt; return (q [L, N, Hq, D], k [L, S, Hkv, D], v, next-token
    logits [V]) as numpy float16 (logits float32), S = len(ids) - N."""
    t = len(ids)
    tp = -(-t // CHUNK) * CHUNK
    cfg = model.cfg
    padded = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, tp - t)))

    @jax.jit
    def run(padded):
        def attend(caches, layer, q, k, v):
            k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
            out = causal_prefill_attention(q, k, v, chunk=CHUNK)
            qs = jax.lax.dynamic_slice_in_dim(q, t - n_queries, n_queries, axis=0)
            return out, tuple(c.at[layer].set(x.astype(jnp.float16))
                              for c, x in zip(caches, (qs, k, v)))

        caches = (jnp.zeros((cfg.num_layers, n_queries, cfg.num_heads, cfg.head_dim), jnp.float16),
                  jnp.zeros((cfg.num_layers, tp, cfg.num_kv_heads, cfg.head_dim), jnp.float16),
                  jnp.zeros((cfg.num_layers, tp, cfg.num_kv_heads, cfg.head_dim), jnp.float16))
        x, (q, k, v) = model.layers(model.embed_tokens(padded), jnp.arange(tp), caches, attend)
        return q, k, v, model.logits(x[t - 1][None])[0]

    q, k, v, logits = run(padded)
    s = t - n_queries
    return (np.asarray(q), np.asarray(k[:, :s]), np.asarray(v[:, :s]),
            np.asarray(logits, np.float32))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", nargs="+", default=["passkey", "gpl3"],
                   choices=["passkey", "gpl3"])
    p.add_argument("--tokens", type=int, default=8000, help="prompt length (about)")
    p.add_argument("--depth", type=float, nargs="+", default=[0.1],
                   help="passkey depths (0 = start of the filler)")
    p.add_argument("--key", type=int, default=68523)
    p.add_argument("--queries", type=int, default=16, help="last positions captured as queries")
    p.add_argument("--layers", type=int, nargs="*", help="layers to compare (default: all)")
    p.add_argument("--budget-tokens", type=int, help="default: a 16th of the context")
    p.add_argument("--sharp-mass", type=float, default=0.5)
    p.add_argument("--save-dir", help="write <prompt>_layer<L>.npz for layers with sharp heads")
    p.add_argument("--per-head", action="store_true", help="print a row per sharp head")
    p.add_argument("--preset", default="model", choices=sorted(PRESETS),
                   help="the config compared (default: what models.Engine runs)")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="HiSparse config overrides (e.g. rerank_multiple=1)")
    args = p.parse_args(argv)
    over = config_overrides(args.set)

    from hisparse_jax.models.registry import load
    model, tok = load(args.model)
    prompts = []
    for name in args.prompts:
        if name == "passkey":
            prompts += [(f"passkey{d}", *passkey_prompt(tok, args.tokens, d, args.key))
                        for d in args.depth]
        else:
            prompts.append(("gpl3", *gpl_prompt(tok, args.tokens)))
    for tag, ids, desc in prompts:
        q, k, v, logits = capture(model, ids, args.queries)
        top = [tok.decode([int(i)]) for i in np.argsort(-logits)[:3]]
        s = k.shape[1]
        budget = args.budget_tokens or max(16, s // 16 // 16 * 16)
        print(json.dumps({"prompt": tag, "desc": desc, "tokens": len(ids), "context": s,
                          "queries": args.queries, "budget_tokens": budget,
                          "next_token_top3": top}), flush=True)
        cfg = config_for(preset(args.preset, budget_tokens=budget, **over), k[0],
                         q.shape[2] // k.shape[2])
        rows_all = []
        for layer in (args.layers if args.layers is not None else range(q.shape[0])):
            rows, recalls = compare(cfg, q[layer], k[layer], v[layer], args.sharp_mass)
            for r in rows:
                r.update(prompt=tag, layer=layer)
            rows_all += rows
            if args.per_head:
                for r in rows:
                    print(json.dumps(r), flush=True)
            if rows:
                print(json.dumps(summarize(rows, recalls, tag, layer=layer)), flush=True)
                if args.save_dir:
                    os.makedirs(args.save_dir, exist_ok=True)
                    np.savez(os.path.join(args.save_dir, f"{tag}_layer{layer}.npz"),
                             q=q[layer], k=k[layer], v=v[layer])
        ours = np.array([r["ours"] for r in rows_all])
        quest = np.array([r["quest"] for r in rows_all])
        print(json.dumps({
            "prompt": tag, "summary": True, "sharp_head_queries": len(rows_all),
            "layers_with_sharp_heads": sorted({r["layer"] for r in rows_all}),
            "ours_mean": round(float(ours.mean()), 4) if len(ours) else None,
            "quest_mean": round(float(quest.mean()), 4) if len(ours) else None,
            "oracle_mean": round(float(np.mean([r["oracle"] for r in rows_all])), 4)
            if len(ours) else None,
            "below_quest": int((ours < quest - 1e-6).sum()),
            "worst_ours_minus_quest": round(float((ours - quest).min()), 4) if len(ours) else None,
            **({"set": args.set} if args.set else {})}), flush=True)


if __name__ == "__main__":
    main()
