"""Capture llama.cpp's behaviour on SmolLM2-135M-Instruct into one small JSON file.

The file (default `tests/data/llamacpp_smollm2.json`) is an independent reference
for our own JAX implementation of the model: tests compare against it without
building llama.cpp. It is captured once, outside CI, with `llama-cpp-python`
0.3.36 built from source (the `llamacpp` extra). A default (-march=native)
build dies with SIGILL on these machines (AMD Zen 4: AVX-512 VNNI but no
AVX-VNNI, no AMX); this build works (about 10 minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
      -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON \
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF \
      -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36

With -DGGML_AVX_VNNI=ON instead, loading works but evaluating the Q4_1 GGUF
dies with SIGILL: `ggml_vec_dot_q4_1_q8_1` executes a VEX `vpdpbusd`, an
AVX-VNNI instruction these CPUs lack (the BF16 GGUF's path does not use it).

What is recorded (schema in `capture`):

- `tokenize`: llama.cpp's `tokenize(text.encode(), add_bos=False, special=True)`
  on ~20 strings (whitespace, digits, code, unicode, emoji, contractions, ChatML
  markers). The model's `add_bos_token` is False.
- `chat`: user prompts rendered with the GGUF's own `tokenizer.chat_template`
  (jinja2, `trim_blocks`/`lstrip_blocks` as transformers renders HF chat
  templates, `add_generation_prompt=True`), tokenized as above, then 32 greedy
  tokens. The greedy loop uses the low-level API only (`eval` one token at a
  time, argmax of the last position's logits): no sampler, no repetition
  penalty, and no stop at EOS (id 2) or `<|im_end|>`: exactly 32 ids are kept.
  `greedy_text` is `detokenize(greedy_ids, special=True)` decoded as UTF-8 with
  `errors="replace"` (special tokens appear as text; a trailing partial UTF-8
  sequence becomes U+FFFD).
- `logits`: the last position's logits (float32, rounded to 4 decimals) after
  each chat prompt and a few raw-text prompts (one ~1000 tokens, which llama.cpp
  evaluates in two n_batch=512 chunks): the 64 largest (ids and values, largest
  first), logsumexp, mean, std and every 64th logit (768 values).

Note: with `logits_all=False`, llama-cpp-python 0.3.36's `Llama.eval` no longer
copies logits into `Llama.scores` (its sampler works inside llama.cpp), so
`scores` holds uninitialised memory. Logits are read here with
`llama_get_logits_ith(ctx, -1)`, the row of the last token of the last batch.

Usage (in a venv with `pip install -e ".[llamacpp]"`, built as above; the GGUF
path is what `hisparse fetch` prints):

    nice -n 19 python benchmarks/capture_llamacpp.py --gguf "$(hisparse fetch smollm2-135m)"
    nice -n 19 python benchmarks/capture_llamacpp.py --gguf "$(hisparse fetch smollm2-135m)" --speed

`--speed` writes no file; it prints one JSON line per context with llama.cpp's
prefill and decode speed (tokens/s) at that context.

`--continuations` writes a second, small file (default
`tests/data/llamacpp_smollm2_bf16.json`) from llama.cpp running the BF16 GGUF
that `hisparse export` writes from the same model: every weight is the bf16
value our model computes with, so the quantized arithmetic above (Q4_1 weights
times Q8_1 activations) is gone from the comparison. llama.cpp multiplies BF16
weights with activations it rounds to bf16 and accumulates in float32, as our
`llama.matmul` does. `--kv-type bf16` also stores K/V in bf16 as we do
(llama.cpp's attention then rounds the query and the probabilities to bf16 for
its two products, where we keep both in float32; with `--flash-attn`, only the
query). Recorded: for each chat prompt (the same messages and template as
above), the 32 greedy ids and text, and at each step llama.cpp's own top-2
margin (its largest logit minus its second); for each prompt of `logits` (chat
prompts, then the raw texts), its last position's top 32 logits, logsumexp,
mean and every 1024th logit. The prompt ids are not repeated: they are the main
file's (`n_prompt` checks the length).

    hisparse export --model smollm2-135m --format gguf smollm2-135m-bf16.gguf
    OMP_WAIT_POLICY=passive nice -n 19 python benchmarks/capture_llamacpp.py \
      --gguf smollm2-135m-bf16.gguf --continuations --kv-type bf16

(`OMP_WAIT_POLICY=passive` changes only how idle OpenMP threads wait: on a
shared machine two spinning ones took 7 minutes instead of 25 s.)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import shlex
import sys
import time

import numpy as np

from hisparse_jax.models.prompts import passkey

N_CTX = 2048
N_GREEDY = 32
TOP_K = 64
STRIDE = 64
EOS_ID = 2

TOKENIZE_TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "",
    " ",
    "   three leading spaces, a  b   c    d and trailing   ",
    "line one\nline two\n\n\nline five\n",
    "windows\r\nline endings\r\n\r\n",
    "\tindented\t\ttabs\t",
    "  \n  \t \r\n  ",
    "pi is 3.14159, a big number 1234567890, a date 2024-12-01, 1,000,000",
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n    return a + b\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "Café déjà vu, naïve façade, Ångström, Straße, Ελληνικά, русский",
    "你好，世界。日本語のテキスト。한국어 문장.",
    "I love 🍕 and 🚀🚀! 👍🏽 👨‍👩‍👧",
    "I'm sure you'll see they've done it, isn't it? We'd, he's, they're, O'Neil",
    "HELLO!!! hello??? HeLLo... (parens) [brackets] {braces} <angle>",
    "https://github.com/ggml-org/llama.cpp?x=1&y=2#frag user@example.com",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text before <|endoftext|> text after <|im_end|>",
]


def _user(text):
    return [{"role": "user", "content": text}]


CHAT_MESSAGES = [
    _user("Write a haiku about the sea."),
    _user("List three prime numbers."),
    _user("What is the capital of France?"),
    _user("Explain recursion in one sentence."),
    _user("Write a Python function that reverses a string."),
    _user("Translate to French: I like apples and cheese."),
    _user("Give me a list of five fruits."),
    _user("What is 12 times 7?"),
    _user("Hi!"),
    _user("Tell me a short story about a robot who learns to paint."),
    _user("What is the boiling point of water in Celsius?"),
    _user("Summarize the plot of Romeo and Juliet in two sentences."),
    [{"role": "system", "content": "You are a pirate. Answer like a pirate."},
     {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "user", "content": "My name is Ada."},
     {"role": "assistant", "content": "Nice to meet you, Ada!"},
     {"role": "user", "content": "What is my name?"}],
]


def _passkey_prompt(n_filler=40, depth=0.5, key=68294):
    """A raw passkey prompt, about 1000 tokens with the defaults."""
    return passkey(n_filler, depth, key)


RAW_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5,",
    "Once upon a time, there",
    _passkey_prompt(),
]


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


KV_TYPES = ("f16", "bf16", "f32")  # --kv-type: llama.cpp's K/V cache type (default f16)
BF16_TOP_K = 32
BF16_STRIDE = 1024


def load(gguf, threads, n_ctx=N_CTX, kv_type=None, flash_attn=False):
    import llama_cpp

    kv = {}
    if kv_type is not None:  # a ggml_type; llama_cpp 0.3.36 lacks GGML_TYPE_BF16 (30)
        from gguf import GGMLQuantizationType
        t = int(GGMLQuantizationType[kv_type.upper()])
        kv = {"type_k": t, "type_v": t}
    return llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads,
                           n_threads_batch=threads, logits_all=False, verbose=False,
                           seed=0, flash_attn=flash_attn, **kv)


def last_logits(llm):
    """float32 copy of the logits of the last evaluated token."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    n_vocab = llm.n_vocab()
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                 shape=(n_vocab,)).astype(np.float32, copy=True)


def eval_prompt(llm, ids):
    llm.reset()
    llm.eval(ids)
    return last_logits(llm)


def greedy(llm, prompt_ids, n=N_GREEDY, margins=None):
    """n greedy ids after prompt_ids and the logits at the prompt's last position.
    margins: a list that gets the top-2 margin of the logits at each step."""
    logits = eval_prompt(llm, prompt_ids)
    first = logits
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        if margins is not None:
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
        if len(out) == n:
            break
        llm.eval([tok])
        logits = last_logits(llm)
    return out, first


def tokenize(llm, text):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def render_chat(template, messages, bos_token, eos_token):
    """Render an HF chat template as transformers does."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos_token, eos_token=eos_token)


def r4(x):
    return round(float(x), 4)


def logits_record(prompt_ids, logits, *, compact: bool = False):
    """Last-position logits: the top TOP_K and every STRIDE-th, the prompt's ids;
    compact: the top BF16_TOP_K and every BF16_STRIDE-th, the prompt's length."""
    top_k, stride = (BF16_TOP_K, BF16_STRIDE) if compact else (TOP_K, STRIDE)
    top = np.argsort(-logits, kind="stable")[:top_k]
    lg = logits.astype(np.float64)
    m = lg.max()
    prompt = ({"n_prompt": len(prompt_ids)} if compact
              else {"prompt_ids": [int(t) for t in prompt_ids]})
    return {
        **prompt,
        "top_ids": [int(t) for t in top],
        "top_logits": [r4(logits[t]) for t in top],
        "logsumexp": r4(m + np.log(np.exp(lg - m).sum())),
        "mean": r4(lg.mean()),
        **({} if compact else {"std": r4(lg.std())}),
        "strided": [r4(v) for v in logits[::stride]],
    }


def r3(x):
    return round(float(x), 3)


def recorded_command(args):
    """This run's command line without machine-specific paths: `python`, the
    script relative to the repository, the GGUF by its file name."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]),
                             os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [os.path.basename(a) if a == args.gguf else a for a in sys.argv[1:]]
    return shlex.join(["python", script] + argv)


def open_model(args):
    llm = load(args.gguf, args.threads, kv_type=args.kv_type, flash_attn=args.flash_attn)
    assert llm.n_vocab() == 49152, llm.n_vocab()
    assert llm.token_eos() == EOS_ID, llm.token_eos()
    template = llm.metadata["tokenizer.chat_template"]
    bos_token = llm._model.token_get_text(llm.token_bos())
    eos_token = llm._model.token_get_text(llm.token_eos())
    return llm, template, bos_token, eos_token


def source_record(args):
    import llama_cpp

    return {
        "gguf": os.path.basename(args.gguf),
        "sha256": sha256_of(args.gguf),
        "llama_cpp_python": llama_cpp.__version__,
        "kv_type": args.kv_type or "f16",
        "flash_attn": args.flash_attn,
        "threads": args.threads,
        "command": recorded_command(args),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {path}: {os.path.getsize(path)} bytes", file=sys.stderr)


def capture_continuations(args):
    """The small file of --continuations (see the module docstring)."""
    llm, template, bos_token, eos_token = open_model(args)
    chat_rows, logit_rows = [], []
    for messages in CHAT_MESSAGES:
        prompt_ids = tokenize(llm, render_chat(template, messages, bos_token, eos_token))
        margins = []
        ids, first = greedy(llm, prompt_ids, margins=margins)
        text = llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
        chat_rows.append({"n_prompt": len(prompt_ids), "greedy_ids": ids, "greedy_text": text,
                          "margins": [r3(m) for m in margins]})
        logit_rows.append(logits_record(prompt_ids, first, compact=True))
        print(f"chat {len(chat_rows)}: {len(prompt_ids)} prompt ids -> {text!r}",
              file=sys.stderr, flush=True)
    for text in RAW_TEXTS:
        prompt_ids = tokenize(llm, text)
        logit_rows.append(logits_record(prompt_ids, eval_prompt(llm, prompt_ids), compact=True))
    # Self-check: a second evaluation of a chat prompt gives the same logits.
    prompt_ids = tokenize(llm, render_chat(template, CHAT_MESSAGES[0], bos_token, eos_token))
    again = logits_record(prompt_ids, eval_prompt(llm, prompt_ids), compact=True)
    assert again == logit_rows[0], "llama.cpp logits are not reproducible"
    write_json(args.out or "tests/data/llamacpp_smollm2_bf16.json",
               {"source": source_record(args), "chat": chat_rows, "logits": logit_rows})


def capture(args):
    llm, template, bos_token, eos_token = open_model(args)

    tok_rows = [{"text": t, "ids": tokenize(llm, t)} for t in TOKENIZE_TEXTS]
    by_text = {r["text"]: r["ids"] for r in tok_rows}
    assert by_text["Hello world"] == [19556, 905], by_text["Hello world"]
    assert by_text["What is the capital of France?"] == [1780, 314, 260, 3575, 282, 4649, 47]

    chat_rows, logit_rows = [], []
    for messages in CHAT_MESSAGES:
        prompt = render_chat(template, messages, bos_token, eos_token)
        prompt_ids = tokenize(llm, prompt)
        ids, first = greedy(llm, prompt_ids)
        text = llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
        chat_rows.append({"messages": messages, "prompt": prompt, "prompt_ids": prompt_ids,
                          "greedy_ids": ids, "greedy_text": text})
        logit_rows.append(logits_record(prompt_ids, first))
        print(f"chat {len(chat_rows)}: {len(prompt_ids)} prompt ids -> {text!r}",
              file=sys.stderr, flush=True)

    for text in RAW_TEXTS:
        prompt_ids = tokenize(llm, text)
        logit_rows.append(logits_record(prompt_ids, eval_prompt(llm, prompt_ids)))
        print(f"raw: {len(prompt_ids)} prompt ids, top {logit_rows[-1]['top_ids'][:3]}",
              file=sys.stderr, flush=True)

    # Self-check: a second evaluation of a chat prompt gives the same logits.
    again = eval_prompt(llm, chat_rows[0]["prompt_ids"])
    rec = logits_record(chat_rows[0]["prompt_ids"], again)
    assert rec == logit_rows[0], "llama.cpp logits are not reproducible"
    assert chat_rows[0]["greedy_ids"][0] == rec["top_ids"][0]

    write_json(args.out or "tests/data/llamacpp_smollm2.json",
               {"source": source_record(args), "tokenize": tok_rows, "chat": chat_rows,
                "logits": logit_rows})


def speed(args):
    """Prefill and decode tok/s at each context (one JSON line per context).

    Prefill: a prompt of exactly `context` tokens (repeated English filler), from
    an empty cache, in n_batch=512 chunks; best of `--reps`. Decode: `--decode`
    greedy tokens one at a time after that prompt, so the cache holds `context`
    to `context + decode` tokens. `*_cpu_s` is the process CPU time of the same
    work: on a busy machine (or under `nice`) wall-clock speed measures the
    scheduler, and `tokens / cpu_s` with `--threads 1` is a load-robust estimate
    of single-core speed (with 2 threads it also counts OpenMP spin-waiting).
    On a loaded machine, 2 threads under `nice` spin and starve each other
    (decode fell to ~2 tok/s here at load 7); `OMP_WAIT_POLICY=passive` in the
    environment avoids it. The policy in force is printed with each line.
    """
    filler = ("The grass is green. The sky is blue. The sun is yellow. "
              "Here we go. There and back again.")
    text = " ".join([filler] * 1000)
    for context in args.contexts:
        llm = load(args.gguf, args.threads, n_ctx=context + args.decode,
                   kv_type=args.kv_type, flash_attn=args.flash_attn)
        ids = tokenize(llm, text)[:context]
        assert len(ids) == context
        eval_prompt(llm, ids[:32])  # warm-up
        prefill, prefill_cpu = [], []
        for _ in range(args.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            logits = eval_prompt(llm, ids)
            prefill.append(time.perf_counter() - t0)
            prefill_cpu.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.decode):
            llm.eval([int(np.argmax(logits))])
            logits = last_logits(llm)
        decode, decode_cpu = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"context": context, "threads": args.threads,
                          "prefill_tok_s": round(context / min(prefill), 1),
                          "prefill_s": [round(s, 3) for s in prefill],
                          "prefill_cpu_s": [round(s, 3) for s in prefill_cpu],
                          "decode_tokens": args.decode,
                          "decode_tok_s": round(args.decode / decode, 1),
                          "decode_cpu_s": round(decode_cpu, 3),
                          "load_avg_1m": round(os.getloadavg()[0], 2),
                          "nice": os.nice(0),
                          "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}), flush=True)
        del llm


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--out", default=None, help="default: tests/data/llamacpp_smollm2.json, "
                                               "with --continuations ..._bf16.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speed", action="store_true", help="measure speed, write no file")
    p.add_argument("--continuations", action="store_true",
                   help="the small file of greedy continuations and logits (BF16 GGUF)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=None,
                   help="llama.cpp's K/V cache type (default: its own, f16)")
    p.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--decode", type=int, default=64, help="decode tokens timed (--speed)")
    p.add_argument("--reps", type=int, default=2, help="prefill repetitions (--speed)")
    args = p.parse_args()
    if args.speed:
        speed(args)
    elif args.continuations:
        capture_continuations(args)
    else:
        capture(args)


if __name__ == "__main__":
    main()
