"""End-to-end quality of a real model through HiSparse against dense attention:
the same model, the same prompts, one run (issue 14).

    python benchmarks/model_quality.py passkey --lengths 2048 4096 7500 --examples 16 \\
        --out passkey.jsonl
    python benchmarks/model_quality.py nexttoken --tokens 6144 --score-from 2048 \\
        --out nexttoken.jsonl
    python benchmarks/model_quality.py passkey --lengths 16384 32768 --examples 4 \\
        --rope-scaling llama3:4 --out rope.jsonl

passkey: the prompt of hisparse_jax/models/prompts.py (raw completion, greedy), the
needle at depths spread evenly over 0.1-0.9, a seeded 5-digit key per example.
Each prompt is prefilled once, exactly (a dense engine), and that K/V seeds every
HiSparse cache (`Engine.prefill_kv`, bit-equal to their own prefill); then each
configuration decodes 8 tokens: dense, HiSparse at cold budgets of 1/16 and 1/32
of the context, and sink + window (no cold page attended: 16 sink tokens and the
newest in the bf16 and fp8 windows).

nexttoken: real text from this machine's own files (licence texts and Python's
own documentation and source; see DOCS), cut to `--tokens` tokens. Teacher
forced: dense logits at every position come from one exact forward pass; each
HiSparse configuration starts from the first `--score-from` tokens' K/V and
decodes the rest of the text one token at a time (`decode_step(tokens=...)`,
the four documents in four slots). Scored at every position from `--score-from`
on: top-1 agreement with dense and mean KL(dense || HiSparse) in nats. "all" (every
cold page attended) is the quantization's share alone.

One JSON line per example / per (document, configuration); a summary at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from hisparse_jax import attention as att
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.config import FULL_BUDGET
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.prompts import passkey_hit, passkey_ids
from hisparse_jax.models.registry import load

ANSWER_TOKENS = 8
SINK_WINDOW = {"attention": "hisparse", "budget_tokens": 0,
               "cache_overrides": {"tail_sample_pages": 0, "rerank_sample_pages": 0}}


def configs(context: int, fractions) -> dict[str, dict]:
    """name -> Engine keyword arguments (attention, budget_tokens, cache_overrides)."""
    out = {"dense": {"attention": "dense"}}
    for f in fractions:
        out[f"1/{f}"] = {"attention": "hisparse", "budget_tokens": context // f // 16 * 16}
    return out


def run_passkey(model, tok, args, out):
    rng = np.random.default_rng(args.seed)
    summary = {}
    for length in args.lengths:
        depths = np.linspace(0.1, 0.9, args.examples)
        keys = rng.integers(10000, 100000, args.examples)
        context = -(-(length + ANSWER_TOKENS + 1) // 256) * 256
        cfgs = configs(length, args.fractions)
        for kw in cfgs.values():
            if args.set and kw.get("attention") == "hisparse":
                kw["cache_overrides"] = dict(args.set)
        cfgs["sink+window"] = SINK_WINDOW
        engines = {n: Engine(model, max_context=context, **kw) for n, kw in cfgs.items()}
        hits = dict.fromkeys(cfgs, 0)
        # --skip: resume a run (the same seeded depths and keys, the first ones done)
        todo = list(zip(depths, keys))[args.skip:]
        if args.only:  # --only: these examples (indices into the seeded list) alone
            todo = [x for i, x in enumerate(zip(depths, keys)) if i in args.only]
        bar = tqdm(todo, desc=f"passkey {length}", file=sys.stderr)
        for depth, key in bar:
            ids = passkey_ids(tok, length, float(depth), int(key))
            dense = engines["dense"]
            first = dense.prefill(0, ids)
            kv = dense.kv(0)
            row = {"task": "passkey", "length": length, "tokens": len(ids),
                   "depth": round(float(depth), 3), "key": int(key),
                   "rope_scaling": args.rope_scaling, **({"set": args.set} if args.set else {})}
            for name, eng in engines.items():
                if eng is not dense:
                    eng.prefill_kv(0, *kv, first)
                gen = [first]
                for _ in range(ANSWER_TOKENS - 1):
                    gen.append(int(eng.decode_step()[0]))
                eng.release(0)
                text = tok.decode(gen)
                hit = passkey_hit(int(key), text)
                hits[name] += hit
                row[name] = {"hit": bool(hit), "text": text}
            del kv
            print(json.dumps(row), file=out, flush=True)
            bar.set_postfix({n: h for n, h in hits.items()})
        summary[length] = {n: f"{h}/{len(todo)}" for n, h in hits.items()}
        del engines
    return summary


# ---------------------------------------------------------------- next-token agreement

def _stdlib(name: str) -> str:
    """`<stdlib>/name`: recorded as such, found through sysconfig (no machine paths)."""
    return f"<stdlib>/{name}"


def _open_doc(path: str):
    if path.startswith("<stdlib>/"):
        path = os.path.join(sysconfig.get_paths()["stdlib"], path.removeprefix("<stdlib>/"))
    return open(path, encoding="utf-8")


# (name, path, licence): real English prose and code every machine of this kind has.
DOCS = [
    ("GPL-3", "/usr/share/common-licenses/GPL-3", "GPL-3 text: verbatim copying permitted"),
    ("pydoc_topics", _stdlib("pydoc_data/topics.py"), "PSF-2.0 (Python's documentation)"),
    ("idlelib_NEWS", _stdlib("idlelib/NEWS.txt"), "PSF-2.0 (IDLE's change log)"),
    ("argparse.py", _stdlib("argparse.py"), "PSF-2.0 (Python's standard library)"),
]


@jax.jit
def _logprobs(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


# Reference selections (`--configs oracle-1/16 quest-1/16 ...`): one forward pass
# whose attention from position `start` on keeps only the sink, the hot and warm
# window (exactly the tiers the cache always attends, at page granularity) and
# budget_pages cold pages per (position, KV head), over unquantized bf16 K/V:
# "oracle" picks the pages with the most exact group mass, "quest" those with the
# highest group maximum of Quest's bound over each page's exact key range. They
# bound what page selection at that budget can reach, with no quantization and no
# tail estimate.
ORACLE_QUERY_CHUNK = 256


def _selected_attention(q, k, v, *, select: str, budget_pages: int, start: int,
                        cfg) -> jax.Array:
    """Exact causal attention [T, Hq, D] for positions < start; from `start` on,
    attention over the always-attended tiers plus `select`'s budget_pages cold pages."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g, pg, c = hq // hkv, cfg.page_size, ORACLE_QUERY_CHUNK
    window_pages = cfg.hot_pages + cfg.warm_pages
    exact = att.causal_prefill_attention(q, k, v, chunk=512)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    npg = t // pg
    key_page = jnp.arange(t) // pg
    kp = kf.reshape(npg, pg, hkv, d)
    lo, hi = kp.min(1), kp.max(1)                                       # [P, Hkv, D]
    scale = 1.0 / math.sqrt(d)

    def chunk(i):
        pos = start + i * c + jnp.arange(c)                             # query positions
        qc = jax.lax.dynamic_slice_in_dim(q, start + i * c, c).astype(jnp.float32)
        qc = qc.reshape(c, hkv, g, d)
        s = jnp.einsum("qhgd,khd->hgqk", qc, kf) * scale                # [Hkv, G, C, T]
        causal = jnp.arange(t)[None, :] <= pos[:, None]                 # [C, T]
        s = jnp.where(causal, s, -jnp.inf)
        last = pos // pg                                                # newest page
        page = jnp.arange(npg)
        cold = (page[None, :] >= cfg.sink_pages) & (page[None, :] <= (last - window_pages)[:, None])
        always = (key_page[None, :] < cfg.sink_pages) | \
            (key_page[None, :] > (last - window_pages)[:, None])        # [C, T]
        if select == "oracle":
            p = jax.nn.softmax(s, axis=-1)
            score = p.reshape(hkv, g, c, npg, pg).sum((1, 4))           # group mass [Hkv, C, P]
        else:  # quest: the group maximum of the bound
            score = (jnp.einsum("qhgd,phd->hgqp", jnp.maximum(qc, 0), hi)
                     + jnp.einsum("qhgd,phd->hgqp", jnp.minimum(qc, 0), lo)).max(1) * scale
        score = jnp.where(cold[None], score, -jnp.inf)
        _, top = jax.lax.top_k(score, budget_pages)                     # [Hkv, C, K]
        chosen = jnp.zeros((hkv, c, npg), bool).at[
            jnp.arange(hkv)[:, None, None], jnp.arange(c)[None, :, None], top].set(True)
        chosen &= cold[None]
        keep = causal[None] & (always[None] | jnp.repeat(chosen, pg, axis=-1))  # [Hkv, C, T]
        w = jax.nn.softmax(jnp.where(keep[:, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("hgqk,khd->qhgd", w, vf).reshape(c, hq, d)

    sparse = jax.lax.map(chunk, jnp.arange((t - start) // c))
    return exact.at[start:].set(sparse.reshape(t - start, hq, d))


def exact_logprobs(model, ids: np.ndarray, start: int, *, select: str | None = None,
                   budget_pages: int = 0, cfg=None) -> np.ndarray:
    """log-softmax of the logits at positions start..T-2 [T-1-start, V]: one exact
    causal forward pass over bf16 K/V, as the engine's prefill attends (with
    `select`, a reference selection's attention from `start` on, above)."""
    from flax import nnx
    graphdef, params = nnx.split(model)

    @jax.jit
    def hidden(params, ids):
        m = nnx.merge(graphdef, params)

        def attend(caches, layer, q, k, v):
            k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
            if select is not None:
                return _selected_attention(q, k, v, select=select, budget_pages=budget_pages,
                                           start=start, cfg=cfg), caches
            return att.causal_prefill_attention(q, k, v, chunk=512), caches

        x, _ = m.layers(m.embed_tokens(ids), jnp.arange(ids.shape[0]), None, attend)
        return x

    @jax.jit
    def logprobs(params, x):
        return _logprobs(nnx.merge(graphdef, params).logits(x))

    padded = np.zeros(-(-len(ids) // 512) * 512, np.int32)  # causal: padding after is unseen
    padded[:len(ids)] = ids
    x = hidden(params, jnp.asarray(padded))
    rows = [np.asarray(logprobs(params, x[i:i + 256]))
            for i in range(start, len(ids) - 1, 256)]
    return np.concatenate(rows)[:len(ids) - 1 - start]


REFERENCE_SELECTIONS = ("oracle", "quest")


def _row(name, path, licence, cname, args, agree, kl, budget):
    return {"task": "nexttoken", "doc": name, "path": path, "licence": licence,
            "config": cname, "tokens": args.tokens, "score_from": args.score_from,
            "positions": len(agree), "top1_agreement": round(float(agree.mean()), 5),
            "mean_kl_nats": round(float(kl.mean()), 6),
            "p99_kl_nats": round(float(np.quantile(kl, 0.99)), 5),
            "max_kl_nats": round(float(kl.max()), 4), "budget_tokens": budget}


def _compare(lp, dense):
    """(top-1 agreement [N] bool, KL(dense || lp) [N]) of log-probs [N, V]."""
    agree = np.argmax(lp, -1) == np.argmax(dense, -1)
    return agree, np.sum(np.exp(dense) * (dense - lp), -1)


def _reference_selection(model, docs, dense_lp, cname, kw, args, out):
    """One forward pass per document with a reference selection's attention."""
    from hisparse_jax.config import HiSparseConfig
    if args.score_from % ORACLE_QUERY_CHUNK:
        raise SystemExit(f"{cname}: --score-from must be a multiple of {ORACLE_QUERY_CHUNK}")
    mc = model.cfg
    cfg = HiSparseConfig(num_kv_heads=mc.num_kv_heads, gqa_group=mc.group,
                         head_dim=mc.head_dim, max_context=args.tokens,
                         budget_tokens=kw["budget_tokens"])
    agree, kl = [], []
    t = time.perf_counter()
    for (name, path, licence, ids), dense in zip(docs, dense_lp):
        lp = exact_logprobs(model, ids, args.score_from, select=kw["select"],
                            budget_pages=cfg.budget_pages, cfg=cfg)
        a, k = _compare(lp, dense)
        agree.append(a)
        kl.append(k)
        print(json.dumps(_row(name, path, licence, cname, args, a, k, cfg.budget_tokens)),
              file=out, flush=True)
    agree, kl = np.concatenate(agree), np.concatenate(kl)
    return {"top1_agreement": round(float(agree.mean()), 5),
            "mean_kl_nats": round(float(kl.mean()), 6),
            "positions": int(agree.size), "forward_s": round(time.perf_counter() - t, 1)}


def run_nexttoken(model, tok, args, out):
    docs = []
    for name, path, licence in DOCS:
        with _open_doc(path) as f:
            ids = np.asarray(tok.encode(f.read()))[:args.tokens]
        if len(ids) < args.tokens:
            raise SystemExit(f"{path}: only {len(ids)} tokens")
        docs.append((name, path, licence, ids))
    t0 = args.score_from
    n = args.tokens - 1 - t0  # scored positions per document
    log = lambda m: print(m, file=sys.stderr, flush=True)
    dense_lp = []
    for name, _, _, ids in docs:
        log(f"exact forward: {name} ({len(ids)} tokens)")
        dense_lp.append(exact_logprobs(model, ids, t0))
    # The harness check: a dense engine's teacher-forced decode equals the exact
    # forward (the same attention over the same bf16 K/V).
    cfgs = {k: v for k, v in configs(args.tokens, args.fractions).items() if k != "dense"}
    cfgs["all"] = {"attention": "hisparse", "budget_tokens": FULL_BUDGET}
    for name, kw in list(cfgs.items()):
        if args.set and kw.get("attention") == "hisparse":
            kw["cache_overrides"] = {**kw.get("cache_overrides", {}), **args.set}
        if args.implementation and kw.get("attention") == "hisparse":
            kw["implementation"] = args.implementation
        if name.startswith("1/"):
            for select in REFERENCE_SELECTIONS:
                cfgs[f"{select}-{name}"] = {"select": select, **kw}
    if args.configs:
        unknown = sorted(set(args.configs) - set(cfgs))
        if unknown:
            raise SystemExit(f"unknown --configs {unknown}; choose from {sorted(cfgs)}")
        cfgs = {k: cfgs[k] for k in args.configs}
    if args.check_dense:
        cfgs = {"dense": {"attention": "dense"}, **cfgs}
    seed_kv = Engine(model, max_seqs=len(docs), max_context=args.tokens + 1, attention="dense")
    kvs, firsts = [], []
    for slot, (_, _, _, ids) in enumerate(docs):
        firsts.append(seed_kv.prefill(slot, ids[:t0]))
        kvs.append(seed_kv.kv(slot))
    del seed_kv
    summary = {}
    for cname, kw in cfgs.items():
        if "select" in kw:
            summary[cname] = _reference_selection(model, docs, dense_lp, cname, kw, args, out)
            log(f"{cname}: {summary[cname]}")
            continue
        eng = Engine(model, max_seqs=len(docs), max_context=args.tokens + 1, **kw)
        steps = n if cname != "dense" else min(n, 128)
        for slot in range(len(docs)):
            if cname == "dense":
                eng.prefill(slot, docs[slot][3][:t0])
            else:
                eng.prefill_kv(slot, *kvs[slot], firsts[slot])
        agree = np.zeros((len(docs), steps), bool)
        kl = np.zeros((len(docs), steps))
        t = time.perf_counter()
        for i in tqdm(range(steps), desc=f"nexttoken {cname}", file=sys.stderr):
            eng.decode_step(tokens=np.array([d[3][t0 + i] for d in docs]))
            lp = np.asarray(_logprobs(eng.logits))
            agree[:, i], kl[:, i] = _compare(lp, np.stack([d[i] for d in dense_lp]))
        secs = time.perf_counter() - t
        budget = eng.cache_cfg.budget_tokens if eng.cache_cfg else None
        for j, (name, path, licence, _) in enumerate(docs):
            print(json.dumps(_row(name, path, licence, cname, args, agree[j], kl[j], budget)),
                  file=out, flush=True)
        summary[cname] = {"top1_agreement": round(agree.mean(), 5),
                          "mean_kl_nats": round(kl.mean(), 6), "positions": int(agree.size),
                          "decode_s": round(secs, 1),
                          **({"implementation": resolve_implementation(eng.implementation,
                                                                       eng.cache_cfg)}
                             if eng.cache_cfg is not None else {})}
        log(f"{cname}: {summary[cname]}")
        del eng
    return summary


def _field_value(kv: str) -> tuple[str, str]:
    if "=" not in kv:
        raise argparse.ArgumentTypeError(f"{kv!r}: expected FIELD=VALUE")
    return tuple(kv.split("=", 1))


def _number_or_text(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("task", choices=("passkey", "nexttoken"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7500])
    p.add_argument("--examples", type=int, default=16)
    p.add_argument("--fractions", type=int, nargs="+", default=[16, 32],
                   help="cold budgets: 1/F of the context")
    p.add_argument("--tokens", type=int, default=6144, help="nexttoken: tokens per document")
    p.add_argument("--score-from", type=int, default=2048)
    p.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                   help="nexttoken: only these configurations (e.g. 1/16 all)")
    p.add_argument("--check-dense", action="store_true",
                   help="nexttoken: also a dense engine's decode (128 steps) against the "
                        "exact forward")
    p.add_argument("--set", nargs="+", default={}, metavar="FIELD=VALUE",
                   type=_field_value,
                   help="HiSparse cache overrides (e.g. tail_sample_pages=0; passkey: the "
                        "1/F budgets, not sink + window)")
    p.add_argument("--implementation", choices=("cpu", "xla", "pallas"), default=None,
                   help="nexttoken: the HiSparse decode's kernels (default: the platform's)")
    p.add_argument("--rope-scaling", default=None, metavar="KIND:FACTOR",
                   help="e.g. llama3:4 or linear:2 (trained length: the model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="passkey: leave out each length's first N examples (resume a run)")
    p.add_argument("--only", type=int, nargs="+", default=None, metavar="I",
                   help="passkey: only these examples (0-based, of --examples)")
    p.add_argument("--out", default="-")
    args = p.parse_args(argv)
    if args.only and args.skip:
        p.error("--only and --skip: give one")
    args.set = {k: _number_or_text(v) for k, v in args.set}
    model, tok = load(args.model, rope_scaling=args.rope_scaling)
    with contextlib.ExitStack() as stack:
        out = sys.stdout if args.out == "-" else stack.enter_context(open(args.out, "a"))
        t = time.perf_counter()
        summary = (run_passkey if args.task == "passkey" else run_nexttoken)(model, tok, args,
                                                                              out)
        print(json.dumps({"summary": summary, "task": args.task, "model": args.model,
                          "seconds": round(time.perf_counter() - t),
                          "command": " ".join(["python", "benchmarks/model_quality.py",
                                               *(argv or sys.argv[1:])])}), file=out,
              flush=True)
    print(json.dumps(summary, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
