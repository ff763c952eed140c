"""Two models in one `hisparse serve` process (the registered SmolLM2 and the same
GGUF by path), each with its own engine, caches, pools and engine thread, routed
by the request's `model`: answers under interleaved load equal each model's
answers alone, so neither overwrote the other's pages. Slots come from
--kv-cache-memory through the capacity planner."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import pytest

from hisparse_jax.models.registry import fetch
from tests.helpers import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve2") / "serve.log"
    gguf = str(fetch("smollm2-135m"))
    args = ["--model", "smollm2-135m", "--model", gguf, "--kv-cache-memory", "16MiB",
            "--max-context", "512"]
    with running_server(args, log, 600) as (url, proc):
        # the capacity planner's slots: 2 full 512-token contexts in 16 MiB (per model)
        assert log.read_text().count("(device 13.2 MiB, host 0.0 MiB), 2 sequences of 512") == 2
        yield url
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "List three prime numbers."]


def test_two_models_route_and_never_share_pages(server):
    models = httpx.get(server + "/v1/models").json()["data"]
    names = [m["id"] for m in models]
    assert names == ["smollm2-135m", "SmolLM2-135M-Instruct.Q4_1"]
    assert models[0]["lineage"]["model_sha256"] == models[1]["lineage"]["model_sha256"]

    def ask(model, prompt, n=10):
        r = httpx.post(server + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.headers["x-hisparse-lineage"].startswith(f"model={model};")
        return r.json()["choices"][0]["text"]

    # the same prompts on both models at once, more than either has slots
    jobs = [(m, p) for p in PROMPTS for m in names]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda j: ask(*j), jobs, timeout=300))
    alone = {p: ask(names[0], p) for p in PROMPTS}
    assert together == [alone[p] for p in PROMPTS for _ in names]
    text = httpx.get(server + "/metrics").text
    for name, n in zip(names, (80, 40)):  # the first also answered alone
        assert f'hisparse:generation_tokens_total{{model_name="{name}"}} {n}.0' in text
    r = httpx.post(server + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "smollm2-135m" in r.json()["error"]["message"]
