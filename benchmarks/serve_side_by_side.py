"""Side by side on this machine: `hisparse serve` (HiSparse and dense) and
llama.cpp's server (llama-cpp-python's `llama_cpp.server` on the same GGUF), the
same workload through `hisparse bench serve`, one JSON row per (server,
concurrency) appended to --out.

    .venv/bin/python benchmarks/serve_side_by_side.py --llama-python LLAMACPP_VENV/bin/python

Each server is started on a free loopback port, waited for, measured and stopped
by PID. llama.cpp runs with 2 threads and OMP_WAIT_POLICY=passive (its spinning
threads otherwise starve everything else on a 2-core machine); it serves one
request at a time (no batching in llama-cpp-python's server), and with
--interrupt_requests False (its default cuts a running stream short when the next
request arrives). It ignores `ignore_eos` and sends no usage: its output tokens are
the streamed chunks, and a request may end early at EOS.
"""

from __future__ import annotations

import argparse
import json
import os
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


def start(cmd, env=None, log=None) -> subprocess.Popen:
    with open(log or os.devnull, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})


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


def stop(proc):
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python[server]")
    p.add_argument("--servers", default="hisparse,dense,llamacpp")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--input-len", default="1024")
    p.add_argument("--output-len", default="64")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/results/serve_side_by_side.jsonl")
    p.add_argument("--log-dir", default=tempfile.gettempdir(),
                   help="each server's output goes to LOG_DIR/serve_NAME.log")
    a = p.parse_args()
    # The recorded command names no path of this machine: the llama.cpp venv is
    # LLAMACPP_VENV, as in docs/serving.md.
    argv = [x.replace(os.path.dirname(os.path.dirname(a.llama_python)), "LLAMACPP_VENV")
            if a.llama_python and x == a.llama_python else x for x in sys.argv]
    from hisparse_jax.models.registry import fetch
    gguf = str(fetch("smollm2-135m"))
    conc = [int(c) for c in a.concurrency.split(",")]
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
        else:
            cmd = [sys.executable, "-m", "hisparse_jax.serving", "--attention", name,
                   "--max-seqs", str(max(conc)), "--max-context", str(a.max_context),
                   "--port", str(port)]
            proc = start(cmd, log=log_path(name))
        try:
            wait_up(url, proc)
            for c in conc:
                hisparse = os.path.join(os.path.dirname(sys.executable), "hisparse")
                bench = [hisparse, "bench", "serve",
                         "--base-url", url, "--input-len", a.input_len, "--output-len",
                         a.output_len, "--num-prompts", str(a.num_prompts if c > 1
                                                            else max(2, a.num_prompts // 2)),
                         "--max-concurrency", str(c), "--warmup", "1", "--ignore-eos",
                         "--no-progress", "--json", "-"]
                r = subprocess.run(bench, capture_output=True, text=True, check=False)
                if r.returncode:
                    print(r.stderr, file=sys.stderr)
                    continue
                row = json.loads(r.stdout.strip().splitlines()[-1])
                row.update(server=name, concurrency=c,
                           command_line=" ".join(["python"] + argv))
                with open(a.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} c={c}: {row['output_throughput']:.2f} tok/s out, "
                      f"TTFT p50 {row['ttft_ms']['median']:.0f} ms, TPOT p50 "
                      f"{row['tpot_ms']['median'] or 0:.0f} p99 {row['tpot_ms']['p99'] or 0:.0f}"
                      " ms", flush=True)
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
