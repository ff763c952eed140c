"""`hisparse bench generate`: prefill and decode speed of a model through HiSparse
and dense attention, with llama.cpp on the same GGUF beside them, in one run.

    hisparse bench generate --model smollm2-135m --context 512,2048,8000 --batch 1,8

One row per (context, batch, engine). Slot 0 is prefilled with a
`context`-token prompt (the passkey filler: English text), block by block as the
server does (`Engine.prefill_chunk`); the other slots get the same prompt from
its K/V (`Engine.prefill_kv`, the cache's encoding without the model: a decode
step's work does not depend on what the tokens are). Then `decode` tokens are
decoded for all slots at once. Compiling is done first (`Engine.warmup`), and one
decode step runs before the timed ones (its call traces the program); neither is
timed, both are in compile_s (llama.cpp's warm-up evaluates 64 tokens, and its
first decode step is untimed too). prefill_tok_s is slot 0's prompt tokens per
second; decode_tok_s counts the generated tokens of all slots.

llama.cpp (`llama-cpp-python`, the `llamacpp` extra) runs one sequence with
`threads` threads: its rows have batch 1, and their decode_tok_s is what 8
sequences one after another would total too. It runs in a child process, so a
llama.cpp build that crashes (a default `-march=native` build dies on AMX CPUs:
build it as `benchmarks/capture_llamacpp.py` says) costs its own row, logged,
and not the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

from hisparse_jax.models.prompts import FILLER

ENGINES = ("hisparse", "dense", "llamacpp")


def prompt(tok, vocab_size: int, context: int) -> np.ndarray:
    if tok is None:  # random weights: any ids will do
        return np.random.default_rng(0).integers(0, vocab_size, context)
    ids = np.asarray(tok.encode((FILLER + " ") * (context // 16 + 16)))
    return ids[:context]


def fill_slots(engine, ids) -> tuple[float, float]:
    """Every slot of `engine` holds the prompt `ids`: slot 0 prefilled block by block
    as the server does, the others from its K/V. -> (slot 0's prefill seconds, the
    other slots' fill seconds)."""
    from hisparse_jax.attention.exact import PREFILL_CHUNK
    context = len(ids)
    t0 = time.perf_counter()
    blocks = engine.prefill_blocks(context)
    for b in range(blocks):
        first = engine.prefill_chunk(0, ids, b * PREFILL_CHUNK)
    t1 = time.perf_counter()
    for slot in range(1, engine.max_seqs):
        if blocks == 1:
            engine.prefill(slot, ids)
        else:
            engine.prefill_kv(slot, *engine.staged_kv(context), first)
    return t1 - t0, time.perf_counter() - t1


def measure(model, ids, attention: str, batch: int, decode: int, budget_tokens: int,
            rerank_multiple: float | None = None, implementation: str | None = None) -> dict:
    from hisparse_jax.backends import resolve_implementation
    from hisparse_jax.models.engine import Engine
    context = len(ids)
    over = {} if rerank_multiple is None else {"rerank_multiple": rerank_multiple}
    engine = Engine(model, max_seqs=batch, max_context=context + decode + 2,
                    attention=attention, budget_tokens=budget_tokens, cache_overrides=over,
                    implementation=implementation if attention == "hisparse" else None)
    compile_s = engine.warmup(context)
    prefill_s, fill_s = fill_slots(engine, ids)
    # The first step traces the decode program (warmup compiled it, without
    # tracing the call): untimed, counted in compile_s.
    t = time.perf_counter()
    engine.decode_step()
    compile_s += time.perf_counter() - t
    t2 = time.perf_counter()
    for _ in range(decode):
        engine.decode_step()
    t3 = time.perf_counter()
    return {"engine": attention, "context": context, "batch": batch,
            "budget_tokens": budget_tokens if attention == "hisparse" else None,
            "rerank_multiple": engine.cache_cfg.rerank_multiple if attention == "hisparse"
            else None,
            "implementation": resolve_implementation(implementation, engine.cache_cfg)
            if attention == "hisparse" else None,
            "prefill": engine.prefill_implementation,  # the exact attention's: "cpu" = the kernel (AMX or AVX-512)
            "prefill_tok_s": round(context / prefill_s, 1),
            "fill_s": round(fill_s, 1),
            "decode_tok_s": round(batch * decode / (t3 - t2), 2),
            "decode_ms_per_step": round(1e3 * (t3 - t2) / decode, 1),
            "compile_s": round(compile_s, 1), "capacity": engine.capacity_line()}


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


LLAMACPP_TIMEOUT_S = 3600


def measure_llamacpp(gguf: str, ids, decode: int, threads: int) -> dict:
    """llama.cpp's row, measured in a child process (`_measure_llamacpp`).
    RuntimeError names what went wrong: the signal it died of, its error, or the
    time limit."""
    job = json.dumps({"gguf": gguf, "ids": [int(i) for i in ids], "decode": decode,
                      "threads": threads})
    code = "from hisparse_jax.harness.generate_bench import llamacpp_child; llamacpp_child()"
    return child_row([sys.executable, "-c", code], job, LLAMACPP_TIMEOUT_S)


def child_row(cmd: list[str], job: str, timeout_s: float) -> dict:
    """Run `cmd` with `job` on stdin; its last stdout line is the row (JSON)."""
    # llama.cpp's OpenMP threads spin between tokens by default, which on 2 shared
    # cores slows everything else (and llama.cpp itself) by 2-3x.
    env = {"OMP_WAIT_POLICY": "passive", **os.environ}
    try:
        proc = subprocess.run(cmd, input=job, capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result within {timeout_s:.0f} s") from None
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        raise RuntimeError(f"its process died of {name}")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        err = proc.stderr.strip().splitlines()
        raise RuntimeError(err[-1] if err else f"exit status {proc.returncode}, no row")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        raise RuntimeError(f"its last line is not a row: {lines[-1][:200]!r}") from None


def llamacpp_child():
    """The child's side of `measure_llamacpp`: the job on stdin, the row on stdout."""
    job = json.load(sys.stdin)
    print(json.dumps(_measure_llamacpp(job["gguf"], job["ids"], job["decode"],
                                       job["threads"])), flush=True)


def _measure_llamacpp(gguf: str, ids, decode: int, threads: int) -> dict:
    import llama_cpp
    context = len(ids)
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=context + decode + 9, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, logits_all=False,
                          verbose=False, seed=0)
    ids = [int(i) for i in ids]
    llm.eval(ids[:64])  # warm-up, untimed
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    llm.eval([ids[0]])  # one untimed decode step, as the engines' rows have
    t1b = time.perf_counter()
    for i in range(decode):  # the inputs' values do not change the work
        llm.eval([ids[(i + 1) % context]])
    t2 = time.perf_counter()
    del llm
    return {"engine": "llamacpp", "context": context, "batch": 1, "budget_tokens": None,
            "rerank_multiple": None,
            "prefill_tok_s": round(context / (t1 - t0), 1),
            "decode_tok_s": round(decode / (t2 - t1b), 2),
            "decode_ms_per_step": round(1e3 * (t2 - t1b) / decode, 1),
            "compile_s": 0.0, "capacity": f"llama.cpp {llama_cpp.__version__}, "
                                          f"{threads} threads, f16 KV cache"}


def run(model_name: str, contexts, batches, engines=ENGINES, decode: int = 32,
        budget_tokens: int | None = None, threads: int = 2, log=print,
        rerank_multiples=(None,), implementations=(None,),
        **overrides) -> Iterator[dict]:
    """Rows, one per (context, batch, engine); llama.cpp once per context (batch 1).
    budget_tokens None: a 16th of each context (a multiple of 16, at least 64).
    HiSparse gets a row per rerank_multiples value (None: the config's default),
    so that candidate counts are timed side by side, and per implementations value
    (HiSparse's kernels: "pallas", "cpu" or "xla"; None: Pallas on a GPU, XLA
    elsewhere), so that kernels are timed side by side."""
    from hisparse_jax.models.registry import load, resolve
    src = resolve(model_name)
    if "llamacpp" in engines and overrides:
        log("llama.cpp skipped: it runs the checkpoint's own RoPE")
        engines = tuple(e for e in engines if e != "llamacpp")
    if "llamacpp" in engines:
        why = (f"{model_name} is not a GGUF model" if src.kind != "gguf" else
               None if llamacpp_available() else "llama-cpp-python is not installed "
               "(the llamacpp extra)")
        if why:
            log(f"llama.cpp skipped: {why}")
            engines = tuple(e for e in engines if e != "llamacpp")
    if not engines:
        raise ValueError("no engine left to measure (llama.cpp was skipped)")
    model, tok = load(model_name, **overrides)  # rope_theta, rope_scaling
    longest = max(contexts) + decode + 2  # what the engine holds (`measure`)
    if longest > model.cfg.max_position:  # past it the model reads untrained positions
        raise ValueError(f"--context {max(contexts)}: with {decode} decode steps past "
                         f"{model_name}'s {model.cfg.max_position} positions; extend them with "
                         "--rope-scaling KIND:FACTOR")
    for context in contexts:
        ids = prompt(tok, model.cfg.vocab_size, context)
        budget = (max(64, context // 16 // 16 * 16) if budget_tokens is None
                  else budget_tokens)  # 0 is sink + window, not the default
        for batch in batches:
            for engine in engines:
                if engine == "llamacpp":
                    if batch != min(batches):
                        continue
                    try:
                        rows = [measure_llamacpp(str(src.path), ids, decode, threads)]
                    except RuntimeError as e:
                        log(f"llama.cpp failed at context {context}: {e} (a build that "
                            "works on AMX CPUs: benchmarks/capture_llamacpp.py)")
                        rows = []
                elif engine == "hisparse":
                    rows = [measure(model, ids, engine, batch, decode, budget, m, impl)
                            for impl in implementations for m in rerank_multiples]
                else:
                    rows = [measure(model, ids, engine, batch, decode, budget)]
                for row in rows:
                    row.update(model=model_name, load_avg_1m=round(os.getloadavg()[0], 2))
                    yield row
