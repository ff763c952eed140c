"""`hisparse` command line: demo, eval, bench, capacity.

Every user error is one line on stderr, `hisparse <command>: error: ...`, with
exit code 2 (`args.CLIError`, argparse's errors, the library's ValueErrors).
`--debug` (anywhere after `hisparse`) shows the traceback instead. Ctrl-C is one
line too, `hisparse <command>: interrupted`, exit code 130; SIGTERM exits 143
after the command's own clean-up (`serve` drains instead).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading

from hisparse_jax.backends import BACKENDS
from hisparse_jax.cli import commands
from hisparse_jax.cli.args import (
    CLIError,
    Parser,
    budget_tokens,
    int_at_least,
    int_list,
    nonnegative_int,
    number,
    positive_int,
)

# What a command may raise for bad input (the library checks every input and names
# it). Anything else is a bug: one line too, exit code 1, --debug for the trace.
USER_ERRORS = (CLIError, ValueError, OSError)


def _add_rerank_flags(p):
    p.add_argument("--tail-sample-pages", type=nonnegative_int, default=None, metavar="N",
                   help="pages sampled to estimate the unselected mass (default: the "
                        "preset's, 32; 0 = selection only)")
    p.add_argument("--rerank-multiple", type=number(1.0), default=None, metavar="X",
                   help="candidate pages per budget page, re-ranked by their int4 keys "
                        "(default: the preset's: 1.25, 2 in 'model'; 1 = no re-rank)")


def build_parser() -> Parser:
    from hisparse_jax.cli.bench_scheduler import add_scheduler_bench_parser
    from hisparse_jax.cli.capacity import add_capacity_parser
    from hisparse_jax.config import PRESETS
    p = Parser(prog="hisparse", description="HiSparse KV cache tools")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    def debug_flag(parser):  # also after the command; SUPPRESS keeps the top-level value
        parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                            help="show tracebacks of errors")
        return parser

    d = debug_flag(sub.add_parser(
        "demo", help="a real model answers a ~7K-token passkey prompt: HiSparse vs dense"))
    demo = commands.DEMO_DEFAULTS
    d.add_argument("--model", default=demo["model"], help="a name, a .gguf file or an HF folder")
    d.add_argument("--tokens", type=int_at_least(256), default=demo["tokens"], metavar="N",
                   help="prompt length in tokens (the model's trained length is the limit)")
    d.add_argument("--depth", type=number(0.0, below=1.0), default=demo["depth"],
                   help="where the key sits in the prompt, 0-1")
    d.add_argument("--key", type=int_at_least(10000), default=demo["key"],
                   help="the 5-digit pass key (default: random)")
    d.add_argument("--budget-tokens", type=budget_tokens, default=demo["budget_tokens"],
                   metavar="N",
                   help="HiSparse cold tokens per KV head (default: a 16th of the prompt)")
    d.add_argument("--synthetic", action="store_true",
                   help="the attention-only demo on a generated context instead")
    d.add_argument("--context", type=positive_int, default=None,
                   help="--synthetic: context length (default 131072)")
    d.set_defaults(func=commands.cmd_demo)

    e = debug_flag(sub.add_parser("eval", help="quality on attention captured from your model"))
    e.add_argument("--qkv", required=True, help="npz with q [N,Hq,D], k [S,Hkv,D], v [S,Hkv,D]")
    e.add_argument("--preset", default="default", choices=sorted(PRESETS))
    e.add_argument("--budget-tokens", type=budget_tokens, default=None,
                   help="cold tokens attended per KV head (a multiple of the page size), "
                        "or 'all'")
    _add_rerank_flags(e)
    e.add_argument("--heads", type=int_list(0), default=None, metavar="I,J,...",
                   help="report over these query heads only (e.g. your retrieval heads)")
    e.add_argument("--oracle-budgets", type=int_list(1), default=None, metavar="N,M,...",
                   help="also report the oracle's recall with N, M, ... cold tokens per "
                        "KV head (multiples of the page size): the budget this attention "
                        "needs, whatever the selection")
    e.add_argument("--implementation", choices=("auto", *BACKENDS), default="auto",
                   help="kernels: auto = Pallas on a GPU, the C++ decode kernels on a "
                        "CPU, where they take the shapes; else XLA")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=commands.cmd_eval)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=Parser)
    a = debug_flag(bsub.add_parser("attention", help="sparse vs dense decode attention (XLA)"))
    a.add_argument("--context", type=positive_int, default=131072)
    a.add_argument("--batch", type=positive_int, default=1)
    a.add_argument("--repeats", type=positive_int, default=7)
    a.add_argument("--preset", default="default", choices=sorted(PRESETS))
    _add_rerank_flags(a)
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=commands.cmd_bench_attention)
    kn = debug_flag(bsub.add_parser("kernels", help="Pallas kernels vs XLA references: time, "
                                    "bytes/s, error (docs/log/kernels.md)"))
    kn.add_argument("--case", default="ci",
                    help="ci, decode_{32k,128k,1m}_b{1,8}, a comma-separated list, or all")
    kn.add_argument("--impl", default="pallas,xla", help="pallas, xla or pallas,xla")
    kn.add_argument("--ops", default="lookup,sparse_decode,step,dense",
                    help="subset of lookup,sparse_decode,step,dense")
    kn.add_argument("--iters", type=positive_int, default=None,
                    help="timed calls per row (median)")
    kn.add_argument("--warmup", type=nonnegative_int, default=None,
                    help="untimed calls after compile")
    kn.add_argument("--json", metavar="FILE", default=None,
                    help="write JSON lines to FILE ('-' = stdout, no table)")
    kn.set_defaults(func=commands.cmd_bench_kernels)

    debug_flag(add_scheduler_bench_parser(bsub))
    from hisparse_jax.cli.models import add_model_bench_parsers
    debug_flag(add_model_bench_parsers(bsub))
    debug_flag(add_capacity_parser(sub))
    from hisparse_jax.cli.models import add_model_parsers
    from hisparse_jax.cli.serve import add_bench_serve_parser, add_serving_parsers
    debug_flag(add_bench_serve_parser(bsub))
    n = len(sub.choices)
    add_model_parsers(sub)
    add_serving_parsers(sub)
    for name in list(sub.choices)[n:]:
        debug_flag(sub.choices[name])
    return p


def _prog(args) -> str:
    return " ".join(["hisparse", args.command] + ([args.bench] if getattr(args, "bench", None)
                                                  else []))


def fail(prog: str, message: str, code: int = 2):
    """One line on stderr, then exit."""
    message = " ".join(str(message).split())  # one line, whatever the message held
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


COMPILE_CACHE_BYTES = 1 << 30


def use_compile_cache():
    """Keep compiled XLA programs beside the fetched models, in $HISPARSE_HOME/jax-cache/cli
    (JAX's persistent cache, keyed by program, options and jax version; least recently
    used entries go past 1 GiB): a later `serve`, `generate` or `demo` loads its
    programs instead of compiling them again (`hisparse serve --max-seqs 4
    --max-context 1024` is up in 5.9 s instead of 10.0 here: docs/log/serving.md). JAX_COMPILATION_CACHE_DIR
    moves it (the test suite sets its own). Not for `hisparse bench`."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    from hisparse_jax.models.registry import home
    jax.config.update("jax_compilation_cache_dir", str(home() / "jax-cache" / "cli"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # named by the command they were given to, not by the top level
        fail(_prog(args), f"unrecognized arguments: {' '.join(unknown)}")
    args.command_line = shlex.join(["hisparse", *argv])  # runs again as written
    if args.command != "bench":  # its rows report compile seconds: compiled, not loaded
        use_compile_cache()
    previous = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread():
        # SIGTERM as an exception: `finally` blocks remove what was half-written
        # (fetch's and export's temporary folders). The server drains on it itself.
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        args.func(args)
    except BrokenPipeError:  # `hisparse ... | head`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
    except USER_ERRORS as e:
        if args.debug:
            raise
        fail(_prog(args), e)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"\n{_prog(args)}: interrupted", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)
    except SystemExit:
        raise
    except Exception as e:  # a bug, not bad input: still no traceback without --debug
        if args.debug:
            raise
        fail(_prog(args), f"internal error: {type(e).__name__}: {e} (rerun with --debug for "
                          "the traceback, and please report it)", code=1)
    finally:
        if previous is not None:  # main() called in a process that goes on (tests)
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
