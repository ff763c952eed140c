"""vLLM-CPU with its own attention against vLLM-CPU with HiSparse, same model, same
workload, one run: KV capacity (vLLM's own "KV cache size: N tokens"), output
tok/s and P99 TPOT (vLLM's own serving benchmark) at long prompts and concurrency.

    .venv-vllm/bin/python -m bridge.bench_side_by_side --model DIR \\
        [--input-len 7500] [--output-len 64] [--num-prompts 8] [--concurrency 8] \\
        [--kv-space-gib 2] [--budget-tokens N] [--variant NAME=JSON ...] \\
        [--out bridge/results/side_by_side_cpu.json]

A `--variant` adds a HiSparse row with HISPARSE_CONFIG=JSON (say, other tiers), run
after the bridge's own settings.

Each server binds 127.0.0.1 on a free port and is stopped (by PID) before the next
starts; both use enforce_eager, max_model_len 8192, no prefix caching. The JSON
holds one row per backend with the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

from bridge import runtime as rt
from bridge.serve import VllmServer

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def run_one(name, args, env_extra, server_extra, log_dir):
    env = dict(os.environ)
    env.pop("HISPARSE_VLLM_CPU", None)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib), TOKENIZERS_PARALLELISM="false")
    env.update(env_extra)
    log = os.path.join(log_dir, f"server_{name}.log")
    common = ["--enforce-eager", "--no-enable-prefix-caching", "--max-model-len",
              str(args.max_model_len), "--max-num-seqs", str(args.concurrency),
              "--dtype", "bfloat16"]
    srv = VllmServer(args.model, env, common + server_extra, log_path=log,
                     start_timeout=900)
    with srv:
        m = CAPACITY.findall(_read(log))
        cmd = [sys.executable, "-m", "bridge.bench_serve", "--backend", "vllm",
               "--base-url", srv.base_url, "--endpoint", "/v1/completions",
               "--model", srv.name, "--tokenizer", args.model, "--dataset-name", "random",
               "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
               "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0",
               "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--save-result", "--result-dir", log_dir,
               "--result-filename", f"bench_{name}.json"]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                           timeout=7200)
        wall = time.perf_counter() - t0
        if r.returncode:
            raise RuntimeError(f"{name}: benchmark failed:\n{(r.stdout + r.stderr)[-3000:]}")
        res = json.loads(_read(os.path.join(log_dir, f"bench_{name}.json")))
        bridge_line = [x for x in _read(log).splitlines() if "HiSparse bridge:" in x]
    keys = ("completed", "failed", "total_input_tokens", "total_output_tokens",
            "output_throughput", "total_token_throughput", "mean_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
            "mean_e2el_ms", "duration")
    row = {"backend": name, "kv_cache_tokens": int(m[0].replace(",", "")) if m else None,
           "server_start_s": round(srv.started_s, 1), "bench_wall_s": round(wall, 1),
           **{k: res.get(k) for k in keys}, "server_args": common + server_extra,
           "env": env_extra, "bridge_log": bridge_line[:1]}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bridge.bench_side_by_side")
    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=7500)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-space-gib", type=float, default=2)
    p.add_argument("--budget-tokens", type=int, default=None,
                   help="HISPARSE_BUDGET_TOKENS (default: the bridge's own, a 16th of "
                        "--max-model-len within 512-2048; the bridge_log line names it)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="one more HiSparse row, with HISPARSE_CONFIG=JSON (repeatable)")
    p.add_argument("--out", default="bridge/results/side_by_side_cpu.json")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    variants = []
    for v in args.variant:  # checked before any server starts
        name, sep, fields = v.partition("=")
        if not (sep and re.fullmatch(r"[\w.-]+", name)) or name in (
                "cpu_attn", "hisparse", *(n for n, _ in variants)):
            p.error(f"--variant {v!r}: NAME=JSON, NAME a new word (not cpu_attn or hisparse)")
        try:
            rt.config_overrides({"HISPARSE_CONFIG": fields})
        except ValueError as e:
            p.error(f"--variant {v!r}: {e}")
        variants.append((name, fields))
    log_dir = args.log_dir or os.path.join(os.path.dirname(args.out) or ".", "logs")
    os.makedirs(log_dir, exist_ok=True)
    hisparse_env = {"HISPARSE_VLLM_CPU": "1"} | (
        {} if args.budget_tokens is None else {"HISPARSE_BUDGET_TOKENS": str(args.budget_tokens)})
    rows = [run_one("cpu_attn", args, {}, [], log_dir),
            *(run_one(name, args, hisparse_env | extra, ["--block-size", "16"], log_dir)
              for name, extra in [("hisparse", {})] + [
                  (n, {"HISPARSE_CONFIG": f}) for n, f in variants])]
    d = rows[0]
    summary = {h["backend"]: {
        "capacity_x": h["kv_cache_tokens"] / d["kv_cache_tokens"],
        "output_throughput_x": h["output_throughput"] / d["output_throughput"],
        "p99_tpot_x": h["p99_tpot_ms"] / d["p99_tpot_ms"]} for h in rows[1:]}
    out = {"command": "python -m bridge.bench_side_by_side " + shlex.join(
        sys.argv[1:] if argv is None else argv), "rows": rows, "summary": summary,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
