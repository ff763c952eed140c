"""`hisparse demo`: a real model answers a long-context question through HiSparse
and through dense attention, side by side.

SmolLM2-135M-Instruct (fetched on first use) reads a ~7,000-token passkey prompt
(prompts.py: a 5-digit key hidden in filler text) and is asked for the key.
Three caches answer: dense (exact attention over bf16 K/V), HiSparse at a cold
budget of a 16th of the context, and sink + window (the first 16 tokens and the
newest ones in the bf16 and fp8 windows, 448 in the model preset; no cold page),
the baseline that cannot see the key.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from tqdm import tqdm

from hisparse_jax.cache import layout
from hisparse_jax.config import FULL_BUDGET
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.prompts import passkey_hit, passkey_ids

ANSWER_TOKENS = 8
SINK_WINDOW = {"budget_tokens": 0,
               "cache_overrides": {"tail_sample_pages": 0, "rerank_sample_pages": 0}}


class _Ticker:
    """A live elapsed-time line while one long jitted call runs (a prefill is one
    program: there is nothing to count inside it)."""

    def __init__(self, desc: str):
        self.bar = tqdm(desc=desc, bar_format="{desc}: {elapsed}", leave=True)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self):
        while not self.done.wait(0.5):
            self.bar.refresh()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.bar.close()


def _cache_bytes(engine: Engine, tokens: int, window: bool = False) -> int:
    """Device bytes this sequence's K/V take in all layers (a sink + window cache
    keeps its sink and window tokens only, in bf16)."""
    mc = engine.model.cfg
    if engine.cache_cfg is None or window:
        if window:
            c = engine.cache_cfg
            tokens = min(tokens, c.page_size * (c.sink_pages + c.hot_pages + c.warm_pages))
        return 2 * mc.num_layers * mc.num_kv_heads * tokens * mc.head_dim * 2
    return mc.num_layers * layout.sequence_bytes(engine.cache_cfg, tokens).device


def _answer(engine: Engine, tok, first: int, key: int) -> dict:
    t = time.perf_counter()
    gen = [first]
    for _ in range(ANSWER_TOKENS - 1):
        gen.append(int(engine.decode_step()[0]))
    decode_s = time.perf_counter() - t
    text = tok.decode(gen)
    return {"text": text.strip().split("\n")[0], "hit": passkey_hit(key, text),
            "decode_tok_s": (ANSWER_TOKENS - 1) / decode_s}


def run_demo(model_name: str = "smollm2-135m", tokens: int = 7000, depth: float = 0.5,
             key: int | None = None, budget_tokens: int | None = None, log=print) -> dict:
    from hisparse_jax.models.registry import load, resolve
    if resolve(model_name).kind == "random":  # before building its weights (16 GB at 8B)
        raise ValueError(f"--model {model_name}: random weights and no tokenizer; the demo "
                         "needs a model with one")
    t0 = time.time()
    log(f"[1/5] loading {model_name} (fetched on first use) ...")
    model, tok = load(model_name)
    if tok is None:
        raise ValueError(f"{model_name}: the demo needs a model with a tokenizer")
    key = int(np.random.default_rng().integers(10000, 100000)) if key is None else key
    ids = passkey_ids(tok, tokens, depth, key)
    n = len(ids)
    if n + ANSWER_TOKENS > model.cfg.max_position:
        raise ValueError(f"--tokens {tokens}: the {n}-token prompt and its {ANSWER_TOKENS}-"
                         f"token answer pass the model's {model.cfg.max_position} positions "
                         "(the demo runs no RoPE scaling)")
    budget = max(64, n // 16 // 16 * 16) if budget_tokens is None else budget_tokens
    context = -(-(n + ANSWER_TOKENS + 1) // 256) * 256
    log(f"[2/5] a {n}-token passkey prompt, key {key} at depth {depth}; compiling the "
        "dense and HiSparse programs ...")
    dense = Engine(model, max_context=context, attention="dense")
    sparse = Engine(model, max_context=context, attention="hisparse", budget_tokens=budget)
    window = Engine(model, max_context=context, attention="hisparse", **SINK_WINDOW)
    for e in (dense, sparse, window):
        e.warmup(n)
    rows = {}
    log("[3/5] prefill (exact attention; HiSparse also encodes its tiers) ...")
    for name, e in (("dense", dense), ("hisparse", sparse)):
        with _Ticker(f"      prefill {n} tokens, {name}"):
            t = time.perf_counter()
            first = e.prefill(0, ids)
            rows[name] = {"prefill_tok_s": n / (time.perf_counter() - t), "first": first}
    log("[4/5] decoding the answers ...")
    for name, e in (("dense", dense), ("hisparse", sparse)):
        rows[name].update(_answer(e, tok, rows[name].pop("first"), key))
    # Sink + window attends no cold page: seed it with the dense prefill's K/V.
    window.prefill_kv(0, *dense.kv(0), first)
    rows["sink+window"] = {"prefill_tok_s": None, **_answer(window, tok, first, key)}
    for name, e in (("dense", dense), ("hisparse", sparse), ("sink+window", window)):
        rows[name]["cache_bytes"] = _cache_bytes(e, n, window=e is window)
    log(f"[5/5] done in {time.time() - t0:.0f} s")

    print(f"\n{model_name}, a {n}-token prompt; the pass key is {key} "
          f"(depth {depth}). HiSparse attends "
          f"{'every' if budget == FULL_BUDGET else budget} cold tokens per KV head.\n")
    print(f"{'attention':<13}{'answer':<22}{'found':>6}{'prefill tok/s':>15}"
          f"{'decode tok/s':>14}{'KV cache (MiB)':>16}")
    for name, r in rows.items():
        pre = "-" if r["prefill_tok_s"] is None else f"{r['prefill_tok_s']:.0f}"
        print(f"{name:<13}{r['text'][:20]!r:<22}{'yes' if r['hit'] else 'no':>6}{pre:>15}"
              f"{r['decode_tok_s']:>14.1f}{r['cache_bytes'] / 2**20:>16.1f}")
    ratio = rows["dense"]["cache_bytes"] / rows["hisparse"]["cache_bytes"]
    print(f"\nHiSparse holds this sequence in {ratio:.1f}x fewer bytes than dense bf16; "
          f"{sparse.capacity_line()}.")
    c = window.cache_cfg
    print(f"sink+window keeps the first {c.sink_tokens} and the newest "
          f"{c.hot_tokens + c.warm_tokens} tokens only (its bytes: those tokens in bf16; "
          "prefilled from the dense K/V).")
    return {"tokens": n, "key": key, "depth": depth, "budget_tokens": budget, "rows": rows}
