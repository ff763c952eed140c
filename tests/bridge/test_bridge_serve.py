"""`vllm serve` (the OpenAI API server of the CPU build) with the plugin and
HISPARSE_VLLM_CPU=1, on 127.0.0.1 and a free port, started and stopped by PID: the
`openai` client gets answers, and vLLM's own serving benchmark runs a bounded,
measured workload (8 requests, concurrency 4) against it. About 2 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from bridge_helpers import ROOT, bridge_env

from bridge.serve import VllmServer


@pytest.fixture(scope="module")
def server(smollm2_hf, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = bridge_env(HISPARSE_VLLM_CPU=1, HISPARSE_BUDGET_TOKENS=480)
    srv = VllmServer(smollm2_hf, env, ["--enforce-eager", "--block-size", "16",
                                       "--no-enable-prefix-caching", "--max-model-len", "4096",
                                       "--max-num-seqs", "4", "--dtype", "bfloat16"],
                     log_path=str(log))
    with srv:
        yield srv, log
    assert srv.proc.poll() is not None  # stopped, children included


def test_openai_client_gets_answers(server):
    import openai
    srv, log = server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=120,
                           max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text
    c = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=16, temperature=0)
    assert c.choices[0].message.content.strip()
    text = log.read_text()
    assert text.count("HiSparse bridge:") == 1, "the backend did not run in the server"
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as m:
        assert b"vllm:" in m.read()


def test_bounded_benchmark_against_the_server(server, smollm2_hf, tmp_path):
    srv, _ = server
    cmd = [sys.executable, "-m", "bridge.bench_serve", "--backend", "vllm",
           "--base-url", srv.base_url, "--endpoint", "/v1/completions", "--model", "smollm2",
           "--tokenizer", smollm2_hf, "--dataset-name", "random", "--random-input-len", "128",
           "--random-output-len", "32", "--num-prompts", "8", "--max-concurrency", "4",
           "--ignore-eos", "--seed", "0", "--disable-tqdm", "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(tmp_path),
           "--result-filename", "bench.json"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=bridge_env(), cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    print({k: res.get(k) for k in ("completed", "failed", "output_throughput",
                                   "median_ttft_ms", "p99_tpot_ms")})
    assert res["completed"] == 8 and res.get("failed", 0) == 0
    assert res["total_output_tokens"] == 8 * 32
    assert res["output_throughput"] > 0 and res["p99_tpot_ms"] > 0
