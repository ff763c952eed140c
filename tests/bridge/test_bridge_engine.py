"""A real vLLM engine (the CPU build) generating through HiSparse on this CPU, against
the same engine with its own attention (CPU_ATTN), same model, same prompts:

- greedy tokens of short chat prompts agree for >= 30 tokens, on at least half of
  them; a divergence before that may only happen where the reference's top two
  tokens are tied within the model's bf16 logit resolution;
- the 7.5K-token passkey prompts are answered as dense answers them, at a cold budget
  of 480 tokens per KV head (1/16 of the context), with chunked prefill on;
- vLLM's own "KV cache size: N tokens" grows by the factor HiSparse's layout
  predicts, at the same VLLM_CPU_KVCACHE_SPACE;
- the bridge logs its capacity line once and crosses torch/JAX without copies;
- a request that never decodes (max_tokens 1) leaves no staged K/V and frees its slot
  once vLLM reports it finished, as every finished request does.

Two engine runs (one each), about 4-5 minutes on 2 cores in all.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest
from bridge_helpers import ROOT, bridge_env

from bridge import runtime as rt
from bridge import workloads as wl

MAX_MODEL_LEN = 8192
BUDGET = 480  # = 7,680 / 16: a sixteenth of the passkey context
SHORT_TOKENS = 40
TIE = 0.25  # nats: two bf16 ulps of a logit in [16, 32)
DEPTHS = (0.2, 0.5)  # both answered by dense attention here; docs/log/vllm.md has more depths


def _prompts():
    rng = random.Random(0)
    keys = [rng.randint(10000, 99999) for _ in DEPTHS]
    short = [{"prompt": wl.chat(q), "max_tokens": SHORT_TOKENS, "logprobs": 2}
             for q in wl.CHAT_QUESTIONS]
    pk = [{"prompt": wl.passkey(wl.FILLERS_7K5, d, k), "max_tokens": 8}
          for d, k in zip(DEPTHS, keys)]
    # One token: sampled from the prefill, so the request never reaches a decode step.
    one = [{"prompt": wl.chat(wl.CHAT_QUESTIONS[0]), "max_tokens": 1}]
    # Three generate calls: the short prompts alone first, so that both engines batch
    # them the same way (vLLM's own rounding depends on the batch), then the one-token
    # request, then the passkeys (vLLM reports a request finished in its next step).
    return {"groups": [short, one, pk]}, keys


def _run(tmp, name, model, env, extra):
    spec, _ = _prompts()
    pf = tmp / "prompts.json"
    pf.write_text(json.dumps(spec))
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "bridge.run_vllm", "--model", model, "--prompts", str(pf),
           "--out", str(out), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
           *extra]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1500)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    res = json.loads(out.read_text())
    m = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    res["logged_kv_tokens"] = [int(x.replace(",", "")) for x in m]
    res["log"] = log
    return res


@pytest.fixture(scope="module")
def runs(smollm2_hf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    dense = _run(tmp, "dense", smollm2_hf, bridge_env(),
                 ["--max-num-batched-tokens", "8192"])
    hs = _run(tmp, "hisparse", smollm2_hf,
              bridge_env(HISPARSE_VLLM_CPU=1, HISPARSE_BUDGET_TOKENS=BUDGET),
              ["--max-num-batched-tokens", "2048", "--chunked-prefill"])
    return dense, hs


def _agree(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_greedy_tokens_equal_cpu_attn(runs):
    dense, hs = runs
    assert dense["backend"] == "vllm" and hs["backend"] == "hisparse"
    n = len(wl.CHAT_QUESTIONS)
    report = []
    for d, h in zip(dense["outputs"][:n], hs["outputs"][:n]):
        k = _agree(d["token_ids"], h["token_ids"])
        ended = k == len(d["token_ids"]) == len(h["token_ids"])
        report.append((k, None if ended else d["margins"][k]))
    print("agreement (tokens, reference top-2 gap at the divergence):", report)
    long_enough = [k >= 30 or (k == len(d["token_ids"]) == len(h["token_ids"]))
                   for (k, _), d, h in zip(report, dense["outputs"], hs["outputs"])]
    # measured: 5 of 8 agree for all 40 tokens; the 3 others diverge where CPU_ATTN's top
    # two logits are 0 or 1 bf16 step apart (vLLM's kernel against itself at another
    # block size or with chunked prefill agrees on all 8: it is the same arithmetic)
    assert sum(long_enough) >= n // 2, report
    for (k, gap), ok in zip(report, long_enough):
        assert ok or gap <= TIE, f"diverged at token {k} where the reference gap is {gap}"


def test_passkey_answered_as_dense(runs):
    dense, hs = runs
    _, keys = _prompts()
    n = len(wl.CHAT_QUESTIONS) + 1  # the passkeys follow the short and one-token groups
    d_hits = [wl.passkey_hit(k, o["text"]) for k, o in zip(keys, dense["outputs"][n:])]
    h_hits = [wl.passkey_hit(k, o["text"]) for k, o in zip(keys, hs["outputs"][n:])]
    print("passkey hits dense", d_hits, "hisparse", h_hits,
          [o["text"] for o in hs["outputs"][n:]])
    assert len(d_hits) == len(h_hits) == len(DEPTHS)
    assert all(o["prompt_tokens"] > 7400 for o in hs["outputs"][n:])
    assert sum(d_hits) >= 1
    assert h_hits == d_hits


def test_capacity_grows_by_the_predicted_factor(runs):
    dense, hs = runs
    (d_tokens,), (h_tokens,) = dense["logged_kv_tokens"], hs["logged_kv_tokens"]
    cfg = rt.make_config(num_kv_heads=3, num_heads=9, head_dim=64, page_size=16,
                         max_model_len=MAX_MODEL_LEN, max_seqs=8,
                         overrides={"budget_tokens": BUDGET})
    # the bytes per token that leave room for the 8 slots' tiers in the 1 GiB budget
    # (VLLM_CPU_KVCACHE_SPACE=1) over SmolLM2's 30 layers
    predicted = rt.predicted_capacity_factor(
        cfg, content_bytes=rt.budget_content_bytes(cfg, 2**30, 30))
    print(f"vLLM KV cache: {d_tokens:,} tokens (CPU_ATTN) -> {h_tokens:,} (HiSparse): "
          f"{h_tokens / d_tokens:.3f}x, layout predicts {predicted:.3f}x")
    # whole blocks: vLLM's 128-token blocks and our 16-token ones round the counts
    assert h_tokens / d_tokens == pytest.approx(predicted, rel=0.01)
    assert h_tokens == hs["kv_cache_tokens_config"]


def test_bridge_logged_once_and_crossed_without_copies(runs):
    _, hs = runs
    lines = [x for x in hs["log"].splitlines() if "HiSparse bridge:" in x and "blocks x" in x]
    assert len(lines) == 1, lines
    assert "budget 480 cold tokens" in lines[0]
    assert "8 slots' tiers 50.7 MiB (taken out of vLLM's explicit KV budget)" in lines[0]
    c = hs["bridge"]
    assert c["layers"] == 30
    assert c["converted"] == len(hs["outputs"]) - 1  # all but the one-token request
    assert c["dlpack_to_jax_copies"] == 0 and c["dlpack_to_torch_copies"] == 0
    assert c["dlpack_to_jax"] > 0 and c["released_stale"] + c["evicted_lru"] <= c["requests"]


def test_a_request_that_never_decodes_frees_its_slot_and_staged_kv(runs):
    """vLLM reports a finished request in its next step, so every request but the
    last group's (the passkeys) was reported before the run ended: all freed their
    slots then, the one-token request's staged K/V with it."""
    _, hs = runs
    c = hs["bridge"]
    assert len(hs["outputs"][len(wl.CHAT_QUESTIONS)]["token_ids"]) == 1
    assert c["released_finished"] >= len(hs["outputs"]) - len(DEPTHS)
    assert c["staged_slots"] == 0 and c["slots_in_use"] <= len(DEPTHS)
    assert c["evicted_lru"] == 0  # never needed: finished requests' slots were free
