"""A real `hisparse serve` process on a free loopback port (one per module,
stopped by PID with SIGTERM at the end), the real SmolLM2-135M, talked to with
the `openai` client and httpx: the API, the faults, a bounded load test and a
graceful stop."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
from models_fixtures import smollm2

from tests.helpers import running_server

KEY = "sk-serving-test"
MODEL = "smollm2-135m"
CONTEXT = 1024
START_S = 600  # model load and the first compiles, on a loaded 2-core machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--max-seqs", "4", "--max-context", str(CONTEXT), "--max-waiting", "12",
            "--api-key", KEY, "--price-per-hour", "2.0",
            "--record-traffic", str(log.with_name("traffic.jsonl"))]
    with running_server(args, log, START_S) as (url, proc):
        yield {"url": url, "proc": proc, "log": log}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tok():
    return smollm2()[1]


def _metrics(server) -> dict[str, float]:
    """/metrics as {series: value}, the (single) model_name label left out."""
    text = httpx.get(server["url"] + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            keep = [x for x in re.findall(r'\w+="[^"]*"', labels)
                    if not x.startswith("model_name=")]
            name = base + ("{" + ",".join(keep) + "}" if keep else "")
            out[name] = float(value)
    return out


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server["url"] + path, content=data, headers=headers, timeout=120, **kw)


FRANCE = "The capital of France is"


def test_start_logs_capacity_models_and_lineage(server, client):
    log = server["log"].read_text()
    assert re.search(r"HiSparse KV cache: [\d.]+x capacity vs bf16 \(device [\d.]+ MiB, host "
                     r"[\d.]+ MiB\), 4 sequences of 1024 tokens", log)
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    lin = models.data[0].model_extra["lineage"]
    assert re.fullmatch(r"[0-9a-f]{64}", lin["model_sha256"])
    assert set(lin) == {"model_sha256", "cache_config_sha256", "package_version", "git_commit"}
    r = httpx.get(server["url"] + "/health")
    assert r.headers["x-hisparse-lineage"].startswith(
        f"model={MODEL};model_sha256={lin['model_sha256']};")


def test_completion_usage_logprobs_and_stop(client, tok):
    r = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0,
                                  logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(" Paris") and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(FRANCE))
    assert r.usage.completion_tokens == 8 == len(c.logprobs.token_logprobs)
    assert "".join(c.logprobs.tokens) == c.text
    for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert len(top) == 2 and lp == pytest.approx(max(top.values()))  # greedy: the best
    # a stop string: its text and what follows are not returned
    s = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0,
                                  stop=["."])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == c.text.split(".")[0]
    # prompt as token ids
    ids = client.completions.create(model=MODEL, prompt=tok.encode(FRANCE), max_tokens=8,
                                    temperature=0)
    assert ids.choices[0].text == c.text


def test_chat_streaming_equals_non_streaming(client, tok):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                       temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tok.chat_ids(msgs))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    lp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens and all(len(c.top_logprobs) == 2
                                                               for c in content)
    # a streamed completion: the same text as the chat template's prompt gives
    prompt = tok.render_chat(msgs)
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                            temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == text


def test_seeds_reproduce(client):
    def draw(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                         temperature=1.0, top_p=0.95, seed=seed).choices[0].text
    a, b, c = draw(7), draw(7), draw(8)
    assert a == b and a != c


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ([1, 2], 400, None),
    ({"prompt": FRANCE, "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": FRANCE, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": FRANCE, "stream": "yes"}, 400, "stream"),
    ({"prompt": 5}, 400, "prompt"),
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": FRANCE, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": FRANCE, "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": FRANCE, "max_tokens": CONTEXT}, 400, "max_tokens"),
    ({"prompt": FRANCE, "n": 2}, 400, "n"),
    ({"prompt": [99999999]}, 400, "prompt"),
    ({"prompt": FRANCE, "seed": -1}, 400, "seed"),
    ({"prompt": FRANCE, "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_4xx_and_the_server_goes_on(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 1}).status_code \
        == 200


def test_api_key_and_chat_errors(server):
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", {"prompt": FRANCE}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["url"] + "/v1/models").status_code == 401
    r = _post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user"}], "n": 3})
    assert r.status_code == 400
    assert _post(server, "/v1/nope", {}).status_code == 404


def test_disconnect_mid_stream_frees_the_slot(server):
    before = _metrics(server)
    body = {"prompt": "Tell me a long story.", "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens (and blank separators)
        assert any(x.startswith("data: ") for x in got)
        assert _metrics(server)["hisparse:num_requests_running"] == 1
    # closed: within a step or two (a decode step here is well under a second)
    deadline = time.monotonic() + 10
    while _metrics(server)["hisparse:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.1)
    after = _metrics(server)
    key = 'hisparse:request_success_total{finished_reason="abort"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after["hisparse:kv_cache_usage_perc"] == 0


def test_prewarm_skips_the_documents_prefill(server, tok):
    doc = tok.encode("The pass key is 71432. Remember it. " +
                     "The grass is green. The sky is blue. " * 70)[:600]
    question = tok.encode("\nWhat is the pass key? The pass key is")
    body = {"prompt": doc + question, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cold = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    before = _metrics(server)
    r = _post(server, "/v1/prewarm", {"context_id": "doc1", "prompt": doc})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_tokens"] == 600 and r.json()["cached_tokens"] == 512
    warm = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    named = _post(server, "/v1/completions", {**body, "prompt": question, "context_id": "doc1"})
    assert warm == cold == named.json()["choices"][0]["text"]  # bit-equal prefill
    after = _metrics(server)
    assert after["hisparse:prefix_cache_hits_total"] - \
        before["hisparse:prefix_cache_hits_total"] == 2 * 512
    # ~600-token sequences have cold pages: decode steps read some (30 layers, 3 KV heads)
    read = after["hisparse:cold_pages_read_total"] - before["hisparse:cold_pages_read_total"]
    assert read > 0 and read % 90 == 0
    assert after["hisparse:poisoned_sequences"] == 0
    assert after['hisparse:kv_tier_tokens{tier="cold"}'] == 0  # all released again
    r = httpx.delete(server["url"] + "/v1/prewarm/doc1", headers={"Authorization":
                                                                   f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["deleted"]
    r = _post(server, "/v1/completions", {**body, "prompt": question, "context_id": "doc1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "context_id"
    r = _post(server, "/v1/prewarm", {"context_id": "short", "prompt": FRANCE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


LOAD_PROMPTS = [
    "The capital of France is",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The grass is green. The sky is blue. " * 70,  # ~630 tokens: a chunked prefill
    "Water boils at",
]


def test_bounded_load_matches_served_alone(server, client):
    """16 clients at once against 4 slots and a queue of 12: every request
    completes, and each greedy answer equals the same request served alone.
    Bounded: 16 requests, 300 s."""
    jobs = [(LOAD_PROMPTS[i % len(LOAD_PROMPTS)], 4 + (i * 5) % 13) for i in range(16)]
    before = _metrics(server)

    def run(job):
        p, n = job
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, jobs, timeout=300))
    wall = time.monotonic() - t
    after = _metrics(server)
    tokens = sum(g[1] for g in got)
    rejected = 'hisparse:request_rejected_total{status="503"}'
    print(f"load: 16 requests, {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s), "
          f"{after.get(rejected, 0) - before.get(rejected, 0):.0f} answered 503")
    # served alone: each prompt once, with its longest max_tokens (greedy answers of
    # fewer tokens are prefixes of it, or stop earlier at EOS)
    alone = {}
    for p in LOAD_PROMPTS:
        n = max(m for q, m in jobs if q == p)
        alone[p] = run((p, n))
    for (p, n), (text, used, reason) in zip(jobs, got):
        ref_text, ref_used, _ = alone[p]
        if reason == "length":
            assert used == n and ref_text.startswith(text), (p, n, text, ref_text)
        else:
            assert (text, used) == (ref_text, ref_used)
    assert after["hisparse:generation_throughput_busy_tokens_per_second"] > 0
    assert after["hisparse:cost_per_1k_generation_tokens_dollars"] > 0


def test_bench_serve_against_the_server(server, capsys):
    from hisparse_jax.cli import main
    main(["bench", "serve", "--base-url", server["url"], "--api-key", KEY, "--tokenizer",
          "none", "--num-prompts", "4", "--input-len", "20:40", "--output-len", "4:8",
          "--max-concurrency", "2", "--warmup", "1", "--ignore-eos", "--slo",
          "ttft_ms=600000,tpot_ms=600000", "--no-progress", "--json", "-"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["command"].startswith("hisparse bench serve --base-url")
    assert row["completed"] == row["requests"] == 4 and row["failed"] == 0
    assert 16 <= row["output_tokens"] <= 32 and row["model"] == MODEL
    assert row["goodput"] == pytest.approx(row["request_throughput"])
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < row[k]["median"] <= row[k]["p99"]


def test_recorded_traffic_replays(server, capsys):
    from hisparse_jax.cli import main
    traffic = server["log"].with_name("traffic.jsonl")
    rows = [json.loads(line) for line in traffic.read_text().splitlines()]
    assert rows[0]["prompt"] == FRANCE and rows[0]["max_tokens"] == 8
    assert any("messages" in r for r in rows) and all("timestamp" in r for r in rows)
    main(["bench", "serve", "--base-url", server["url"], "--api-key", KEY, "--tokenizer",
          "none", "--dataset", "replay", "--dataset-path", str(traffic), "--num-prompts", "3",
          "--replay-speed", "1000", "--warmup", "0", "--no-progress", "--json", "-"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["completed"] == 3 and row["output_tokens"] == 8 + 8 + 8


def test_queue_full_answers_503_with_retry_after(server):
    """4 slots and 12 waiting: of 24 requests sent at once, some are turned away
    at once with 503 and Retry-After; the accepted ones all complete."""
    body = {"prompt": FRANCE, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        rs = list(pool.map(lambda _: _post(server, "/v1/completions", body), range(24),
                           timeout=300))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 503} and codes.count(200) >= 16, codes
    busy = next(r for r in rs if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in rs if r.status_code == 200)


def test_sigterm_finishes_running_requests_and_exits_0(server):
    proc = server["proc"]
    body = {"prompt": FRANCE, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        next(lines)
        os.kill(proc.pid, signal.SIGTERM)
        rest = list(lines)
    assert "data: [DONE]" in rest  # the running stream was finished, not cut
    assert proc.wait(timeout=60) == 0
    assert "stopped" in server["log"].read_text()
