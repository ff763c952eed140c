"""vLLM's own serving benchmark (the CPU build's `vllm bench serve` code, run as
`python -m bridge.bench_serve`: what a vLLM user points at a server) against our
`hisparse serve`, started in the main environment on a free loopback port and
stopped by PID. Completions and chat: every request completes with the tokens it
asked for, and the TTFT it measures is the first token's, never less than the
server's own (a chat stream that sent its role in a chunk before the prefill gave
~30 ms at 200-token prompts). About a minute over the main suite's compile cache."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import httpx
import pytest
from bridge_helpers import ROOT, bridge_env

from tests.helpers import running_server

PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 160, 8


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    main_py = os.environ.get("HISPARSE_MAIN_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    py = main_py if pathlib.Path(main_py).exists() else sys.executable
    log = tmp_path_factory.mktemp("ours") / "serve.log"
    # test_serving_api.py's server settings: its programs are in the compile cache
    with running_server(["--max-seqs", "4", "--max-context", "1024"], log, 600,
                        python=py) as (url, _):
        yield url


def _server_ttft(url) -> tuple[float, float]:
    """The server's own TTFT histogram: (sum in s, count)."""
    text = httpx.get(url + "/metrics").text

    def total(k):
        return sum(float(v) for v in re.findall(
            rf"^hisparse:time_to_first_token_seconds_{k}\{{[^}}]*\}} (\S+)$", text,
            re.MULTILINE))
    return total("sum"), total("count")


@pytest.mark.parametrize("backend, endpoint", [("openai", "/v1/completions"),
                                               ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_against_hisparse_serve(ours, smollm2_hf, tmp_path, backend, endpoint):
    before = _server_ttft(ours)
    cmd = [sys.executable, "-m", "bridge.bench_serve", "--backend", backend,
           "--base-url", ours, "--endpoint", endpoint, "--model", "smollm2-135m",
           "--tokenizer", smollm2_hf, "--dataset-name", "random",
           "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
           "--num-prompts", str(PROMPTS), "--max-concurrency", "2", "--ignore-eos",
           "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=bridge_env(),
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    print({k: res.get(k) for k in ("completed", "failed", "output_throughput",
                                   "mean_ttft_ms", "p99_tpot_ms")})
    assert res["completed"] == PROMPTS and res.get("failed", 0) == 0
    assert res["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    after = _server_ttft(ours)
    server_ms = 1000 * (after[0] - before[0]) / (after[1] - before[1])
    assert after[1] - before[1] == PROMPTS
    # the client's clock starts before the server's and stops after it
    assert res["mean_ttft_ms"] >= server_ms, (res["mean_ttft_ms"], server_ms)
    assert res["p99_tpot_ms"] > 0
