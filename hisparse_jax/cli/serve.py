"""`hisparse serve`: the OpenAI-compatible server. `add_serving_parsers(sub)` adds
it to the `hisparse` parser's subparsers; `add_bench_serve_parser(bsub)` adds
`hisparse bench serve` (cli/bench_serve.py) under `hisparse bench`."""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading

from hisparse_jax import backends
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.cli.args import (
    budget_tokens,
    int_at_least,
    nonnegative_int,
    number,
    positive_int,
)
from hisparse_jax.config import default_budget_tokens

log = logging.getLogger("hisparse.serve")
# Under --tpot-slo-ms, prompts whose first tokens may wait for each other, so that
# their streams decode together (the scheduler's gangs): each holds a bf16 K/V stage
# of max_context tokens (94 MiB for SmolLM2 at 8K) until its last block runs.
GANG_STAGES = 2
SHUTDOWN_GRACE_S = 10  # after --shutdown-timeout: for the ended streams' last chunks


def build_state(cfg):
    """Load each model, build its engine (compiled for short prompts) and its
    scheduler: everything `app.build_app` serves."""
    import pathlib

    from hisparse_jax.models.engine import Engine
    from hisparse_jax.models.generate import stop_ids
    from hisparse_jax.models.registry import load, resolve
    from hisparse_jax.offload import policy as scheduler
    from hisparse_jax.serving.app import Served, State, lineage
    from hisparse_jax.serving.batcher import Scheduler
    from hisparse_jax.serving.metrics import Metrics

    metrics = Metrics(cfg.price_per_hour)
    models = {}
    for source in cfg.models:
        src = resolve(source)
        name = source if src.path is None or src.kind == "gguf" and not pathlib.Path(
            source).exists() else pathlib.Path(source).stem
        if name in models:
            raise ValueError(f"--model {source}: served twice as {name!r}")
        model, tok = load(source)
        trained = model.cfg.max_position
        if cfg.max_context and cfg.max_context > trained and src.kind != "random":
            # trained weights answer garbage past it (random ones have nothing to lose)
            raise ValueError(f"--max-context {cfg.max_context}: past {name}'s {trained} "
                             "trained positions")
        context = cfg.max_context or trained
        budget = (default_budget_tokens(context) if cfg.budget_tokens is None
                  else cfg.budget_tokens)
        seqs, line = plan_slots(model.cfg, context, cfg, budget)
        pool = None if cfg.kv_pool_pages is None else {"num_pool_pages": cfg.kv_pool_pages}
        policy = None
        if cfg.offload:
            policy = scheduler.LRU if cfg.offload_policy == "lru" else scheduler.Policy()
        engine = Engine(model, max_seqs=seqs, max_context=context,
                        attention=cfg.attention, budget_tokens=budget,
                        cache_overrides=pool, offload=cfg.offload, policy=policy,
                        max_stages=1 if cfg.tpot_slo_ms is None else min(seqs, GANG_STAGES),
                        implementation=cfg.implementation if cfg.attention == "hisparse"
                        else None)
        log.info("%s: %s", name, line)
        if cfg.attention == "hisparse":
            log.info("%s: decode budget %d cold tokens per KV head%s", name, budget,
                     "" if cfg.budget_tokens is not None else " (a 16th of the context, "
                     "within 512-2048; --budget-tokens sets it)")
        log.info("%s: %s", name, engine.capacity_line())
        if engine.cache_cfg is not None:
            c = engine.cache_cfg
            log.info("%s: cold page pool: %d pages per layer (%d per full context); "
                     "admission reserves prompt + max_tokens worth of pages", name,
                     c.pool_pages, int(engine.cache_cfg.max_pages - c.sink_pages - c.hot_pages
                                       - c.warm_pages))
        if cfg.fault_injection:
            log.warning("%s: fault injection is ON (requests may poison themselves "
                        "with fault_nan_kv_after): for tests only", name)
        kernels = ("" if engine.cache_cfg is None else
                   f", {resolve_implementation(engine.implementation, engine.cache_cfg)} kernels")
        prefill = backends.describe("causal_attention", engine.prefill_implementation)
        log.info("%s: compiling (%s attention%s; exact prefill on %s) ...", name,
                 cfg.attention, kernels, prefill)
        log.info("%s: compiled in %.1f s", name, engine.warmup())
        bound = metrics.bind(name, offload=engine.offload)
        sched = Scheduler(engine, tok, max_waiting=cfg.max_waiting,
                          prefill_budget=cfg.prefill_budget,
                          tpot_slo=None if cfg.tpot_slo_ms is None else cfg.tpot_slo_ms / 1000,
                          metrics=bound)
        models[name] = Served(name=name, source=source, engine=engine, tokenizer=tok,
                              eos=stop_ids(model, tok), scheduler=sched, metrics=bound,
                              lineage=lineage(engine, src.path))
        log.info("%s: lineage %s", name, models[name].lineage)
    return State(cfg=cfg, models=models, metrics=metrics)


def plan_slots(mc, context: int, cfg, budget: int) -> tuple[int, str]:
    """(sequence slots, the capacity line) from the capacity planner: --max-seqs,
    or as many full contexts as --kv-cache-memory holds; `budget`: the HiSparse
    decode budget (tokens)."""
    from hisparse_jax import capacity
    from hisparse_jax.models.engine import model_cache_config
    shape = capacity.ModelShape("served", mc.num_layers, mc.num_kv_heads, mc.num_heads,
                                mc.head_dim)
    if cfg.attention == "hisparse":
        preset = model_cache_config(mc, context, 1, budget)  # what the engine runs
        p = capacity.plan(shape, context, cfg.kv_cache_memory, preset=preset,
                          offload=cfg.offload)
        per_seq, host = p["device_bytes"], p["host_bytes"]
        seqs = p.get("max_sequences", cfg.max_seqs)
    else:
        per_seq, host = 2 * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * context, 0
        seqs = cfg.kv_cache_memory // per_seq if cfg.kv_cache_memory else cfg.max_seqs
    if seqs < 1:
        raise ValueError(f"--kv-cache-memory {cfg.kv_cache_memory}: not one sequence of "
                         f"{context} tokens fits (one needs {capacity.fmt_bytes(per_seq)})")
    dev = capacity.fmt_bytes(per_seq * seqs)
    if cfg.attention == "hisparse":
        line = (f"HiSparse KV cache: {p['capacity_vs_bf16']:.1f}x capacity vs bf16 (device "
                f"{dev}, host {capacity.fmt_bytes(host * seqs)}), {seqs} sequences of "
                f"{context} tokens")
    else:
        line = f"dense bf16 KV cache: device {dev}, {seqs} sequences of {context} tokens"
    return seqs, line


def serve(cfg):
    """Run the server until SIGTERM or SIGINT: then it stops admitting (the socket
    closes), lets running requests finish for up to cfg.shutdown_timeout seconds,
    ends the rest (their streams get finish_reason "abort" and [DONE]) and returns
    (exit code 0)."""
    import uvicorn

    from hisparse_jax.serving.app import build_app

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    # JAX's INFO lines (e.g. "Unable to initialize backend 'tpu'" on every CPU or GPU
    # machine) read as errors in a server log
    logging.getLogger("jax").setLevel(logging.WARNING)
    st = build_state(cfg)

    # On the first signal the engines end what still runs at the deadline, so that
    # its streams close properly before uvicorn's own. The thread that does it waits
    # from the start: a signal handler only sets an event (starting a thread there
    # could deadlock on threading's own lock, held by the code it interrupted).
    stopping = threading.Event()

    def drain():
        stopping.wait()
        st.drain()

    threading.Thread(target=drain, name="hisparse-drain", daemon=True).start()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # uvicorn re-raises a captured signal after shutting down (exit code
            # 143): a graceful stop is a normal exit here.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            st.stop_admitting()  # /health answers 503 from now on
            stopping.set()

    # uvicorn's deadline, a backstop: by then the streams have ended (SHUTDOWN_GRACE_S
    # for their last chunks to go out)
    config = uvicorn.Config(build_app(st), host=cfg.host, port=cfg.port, log_level="info",
                            timeout_graceful_shutdown=math.ceil(cfg.shutdown_timeout
                                                                + SHUTDOWN_GRACE_S),
                            access_log=False)
    Server(config).run()
    log.info("stopped")


def main_serve(args):
    from hisparse_jax.serving.app import ServeConfig
    cfg = ServeConfig(models=tuple(args.model or ["smollm2-135m"]), max_seqs=args.max_seqs, max_context=args.max_context,
                      attention=args.attention, budget_tokens=args.budget_tokens,
                      api_key=args.api_key, host=args.host, port=args.port,
                      price_per_hour=args.price_per_hour, max_waiting=args.max_waiting,
                      prefill_budget=args.prefill_budget, tpot_slo_ms=args.tpot_slo_ms,
                      record_traffic=args.record_traffic,
                      max_request_bytes=args.max_request_bytes,
                      shutdown_timeout=args.shutdown_timeout,
                      kv_cache_memory=args.kv_cache_memory,
                      kv_pool_pages=args.kv_pool_pages, fault_injection=args.fault_injection,
                      offload=args.offload, offload_policy=args.offload_policy,
                      implementation=args.implementation)
    serve(cfg)


def add_serving_parsers(subparsers):
    """Adds `serve` to an argparse subparsers object."""
    from hisparse_jax.models.registry import MODELS

    s = subparsers.add_parser("serve", help="an OpenAI-compatible server (continuous "
                              "batching over HiSparse)")
    s.add_argument("--model", action="append", default=None,
                   help=f"a name ({', '.join(sorted(MODELS))}), a .gguf file or an HF folder; "
                        "repeat it to serve several models, routed by the request's "
                        "'model' (default smollm2-135m)")
    s.add_argument("--max-seqs", type=positive_int, default=8, metavar="N",
                   help="sequence slots (requests decoded together)")
    s.add_argument("--max-context", type=int_at_least(2), default=None, metavar="N",
                   help="tokens per sequence, prompt + completion (default: the model's)")
    s.add_argument("--kv-cache-memory", type=_size, default=None, metavar="BYTES",
                   help="KV cache budget (e.g. 2GiB): the slots are as many full contexts "
                        "as it holds, by the capacity planner (instead of --max-seqs)")
    s.add_argument("--kv-pool-pages", type=positive_int, default=None, metavar="N",
                   help="cold page pool per layer (default: every slot's full context); "
                        "admission reserves each request's prompt + max_tokens worth of "
                        "pages, so a smaller pool makes requests wait, never fail mid-way")
    s.add_argument("--offload", action="store_true",
                   help="keep the cold pages in host memory (HiSparse): the device holds "
                        "their digests and a working set per sequence, so a context may "
                        "exceed --kv-cache-memory (the planner counts device bytes only)")
    s.add_argument("--offload-policy", choices=("predictive", "lru"), default="predictive",
                   help="the working sets' scheduler: predictive also prefetches the layer "
                        "below's candidates (more copies, a higher hit rate), lru only "
                        "copies what a step misses")
    s.add_argument("--fault-injection", action="store_true",
                   help="tests only: honour a request's 'fault_nan_kv_after': N (its K/V "
                        "turn NaN after N tokens)")
    s.add_argument("--attention", choices=("hisparse", "dense"), default="hisparse")
    s.add_argument("--implementation", choices=backends.BACKENDS, default=None,
                   help="HiSparse's kernels (default: Pallas on a GPU, the C++ decode "
                        "kernels on a CPU where they build, else XLA)")
    s.add_argument("--budget-tokens", type=budget_tokens, default=None, metavar="N",
                   help="cold tokens attended per KV head (multiple of 16), or 'all' "
                        "(default: a 16th of --max-context, at least 512, at most 2048)")
    s.add_argument("--api-key", default=None, metavar="K",
                   help="require 'Authorization: Bearer K' on /v1/*")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes the server)")
    s.add_argument("--port", type=nonnegative_int, default=8000)
    s.add_argument("--price-per-hour", type=number(0.0), default=None, metavar="X",
                   help="dollars per hour of this machine, for the $/1K-tokens metric")
    s.add_argument("--max-waiting", type=nonnegative_int, default=64, metavar="N",
                   help="wait queue bound; beyond it requests get 503 + Retry-After")
    s.add_argument("--prefill-budget", type=positive_int, default=512, metavar="TOKENS",
                   help="prompt tokens prefilled per engine step, between decode steps: "
                        "more gives more throughput under load, and longer gaps between "
                        "the running streams' tokens (vLLM's CPU server steps 2,048)")
    s.add_argument("--tpot-slo-ms", type=number(0.0, above=True), default=None, metavar="MS",
                   help="a target for each request's time per output token: a prompt "
                        "block runs beside the running decodes only where it keeps every "
                        "one of them within it (judged from the block's last time); "
                        "waiting prompts pay in time to first token; and up to "
                        f"{GANG_STAGES} prompts start decoding together where their "
                        "step fits it (default: none, one block per step)")
    s.add_argument("--max-request-bytes", type=_size, default=None, metavar="BYTES",
                   help="a longer request body gets a 413 (default: room for the longest "
                        "prompt the context holds, JSON-escaped, and 4MiB)")
    s.add_argument("--shutdown-timeout", type=number(0.0), default=30.0, metavar="S",
                   help="on SIGTERM: seconds the running requests have to finish before "
                        "they are ended (finish_reason 'abort')")
    s.add_argument("--record-traffic", default=None, metavar="FILE.jsonl",
                   help="append every accepted request (with its arrival time) to FILE, "
                        "for `hisparse bench serve --dataset replay`")
    s.set_defaults(func=main_serve)
    return subparsers



def add_bench_serve_parser(bench_subparsers):
    """Adds `serve` under `hisparse bench` (a load generator for any
    OpenAI-compatible server); returns its parser."""
    from hisparse_jax.cli.bench_serve import add_arguments, main_bench_serve
    b = bench_subparsers.add_parser("serve", help="load an OpenAI-compatible server: TTFT, "
                                    "TPOT, ITL, E2EL, throughput, goodput")
    add_arguments(b)
    b.set_defaults(func=main_bench_serve)
    return b


def _size(text: str) -> int:
    import argparse

    from hisparse_jax.capacity import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
