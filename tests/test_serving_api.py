"""Real `hisparse serve` processes on free loopback ports (tests.helpers.running_server:
stopped by PID), the real SmolLM2-135M, talked to with the `openai` client and httpx:
the API, the faults, a bounded load test and a graceful stop. Three servers: the
main one (one per module, stopped with SIGTERM by the last test), the load test's
own (a deeper queue) and the fault server (a tiny cold page pool, --fault-injection)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import os
import random
import re
import shlex
import signal
import threading
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
            "--api-key", KEY, "--price-per-hour", "2.0", "--shutdown-timeout", "5",
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


def _post(server, path, body, key=KEY, timeout=120, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server["url"] + path, content=data, headers=headers, timeout=timeout,
                      **kw)


FRANCE = "The capital of France is"


def test_start_logs_capacity_models_and_lineage(server, client):
    log = server["log"].read_text()
    assert re.search(r"HiSparse KV cache: [\d.]+x capacity vs bf16 \(device [\d.]+ MiB, host "
                     r"[\d.]+ MiB\), 4 sequences of 1024 tokens", log)
    assert "decode budget 512 cold tokens per KV head (a 16th of the context" in log
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    lin = models.data[0].model_extra["lineage"]
    assert re.fullmatch(r"[0-9a-f]{64}", lin["model_sha256"])
    assert set(lin) == {"model_sha256", "cache_config_sha256", "package_version", "git_commit"}
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", lin["git_commit"])
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
    # no chunk before the first token (a client that times the first chunk, as vLLM
    # 0.32's `bench serve` does, would take it for the first token); it carries the role
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
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
    ({"prompt": [5] * CONTEXT}, 400, "prompt"),  # no room for a token, whatever max_tokens
    ({"prompt": "abc\ud800"}, 400, "prompt"),  # valid JSON, not valid Unicode
    ({"prompt": FRANCE, "n": 0}, 400, "n"),
    ({"prompt": FRANCE, "n": 17}, 400, "n"),
    ({"prompt": [99999999]}, 400, "prompt"),
    ({"prompt": FRANCE, "seed": 2**64}, 400, "seed"),  # OpenAI's seed: a 64-bit int
    ({"prompt": FRANCE, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": FRANCE, "top_k": -2}, 400, "top_k"),
    ({"prompt": FRANCE, "model": "gpt-4"}, 404, "model"),
    ({"prompt": FRANCE, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": FRANCE, "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"prompt": FRANCE, "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"prompt": FRANCE, "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ({"prompt": FRANCE, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"prompt": FRANCE, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    # not implemented: refused, never answered as if not set
    ({"prompt": FRANCE, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ({"prompt": FRANCE, "best_of": 2}, 400, "best_of"),
    ({"prompt": FRANCE, "suffix": "!"}, 400, "suffix"),
])
def test_bad_requests_get_4xx_and_the_server_goes_on(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 1}).status_code \
        == 200


def test_n_choices(client):
    """n choices: the i-th is what n=1 gives with seed + i (greedy: all the same),
    the prompt counted once in the usage; streamed, each choice's deltas carry its
    index, its role first and one finish, and add up to the same texts."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
          "seed": 5}
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        alone = client.completions.create(**{**kw, "seed": 5 + c.index})
        assert c.text == alone.choices[0].text and c.finish_reason == "length"
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * 8
    greedy = client.completions.create(n=2, **{**kw, "temperature": 0})
    assert greedy.choices[0].text == greedy.choices[1].text
    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=6,
                                          temperature=1.0, seed=9)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, n=2, max_tokens=6, temperature=1.0, seed=9, stream=True,
        stream_options={"include_usage": True}))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == chat.choices[i].message.content
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert [c.finish_reason for c in mine if c.finish_reason] == \
            [chat.choices[i].finish_reason]
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def test_logit_bias_and_penalties(client, tok):
    """A logit bias bans or forces tokens; a frequency penalty changes a greedy
    answer, the same way every time; logprobs stay the model's own."""
    def complete(**kw):
        return client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=6,
                                          temperature=0, logprobs=1, **kw).choices[0]
    plain = complete()
    paris = tok.encode(" Paris")
    assert plain.text.startswith(" Paris") and len(paris) == 1
    banned = complete(logit_bias={str(paris[0]): -100})
    assert not banned.text.startswith(" Paris")
    forced = complete(logit_bias={str(paris[0]): 100})
    assert forced.text == " Paris" * 6
    # the forced token's logprob is the model's (a bias of 100 would make it ~0)
    assert forced.logprobs.token_logprobs[1] < -1
    story = {"prompt": "Once upon a time, there was", "max_tokens": 40, "temperature": 0}
    a = client.completions.create(model=MODEL, **story).choices[0].text
    b = client.completions.create(model=MODEL, frequency_penalty=1.5, presence_penalty=0.5,
                                  **story).choices[0].text
    assert a != b and b == client.completions.create(
        model=MODEL, frequency_penalty=1.5, presence_penalty=0.5, **story).choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=3,
        temperature=0, logit_bias={str(paris[0]): 100})
    assert chat.choices[0].message.content == " Paris" * 3 or \
        chat.choices[0].message.content == "Paris" + " Paris" * 2


def test_neutral_values_of_parameters_not_implemented_are_accepted(server):
    """What clients send by default (vLLM's bench's repetition_penalty 1, no tools,
    a text response format, best_of 1, no suffix) is served; any other value is a
    400 naming the parameter (table above)."""
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "logit_bias": {}, "max_tokens": 2}
    r = _post(server, "/v1/completions", {"prompt": FRANCE, "best_of": 1, "suffix": "",
                                          **neutral})
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "Hi"}], **neutral}
    r = _post(server, "/v1/chat/completions",
              {**chat, "tools": [], "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    for extra, param in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format")):
        r = _post(server, "/v1/chat/completions", {**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_api_key_and_chat_errors(server):
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", {"prompt": FRANCE}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["url"] + "/v1/models").status_code == 401
    r = _post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    hi = {"role": "user", "content": "Hi"}
    r = _post(server, "/v1/chat/completions", {"messages": [hi], "n": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    for bad, param in (([{"role": "user"}], "messages"),  # no content (an assistant's may be)
                       ([{"role": "user", "content": None}], "messages"),
                       ([{"role": "user", "content": "\ud800"}], "messages")):
        r = _post(server, "/v1/chat/completions", {"messages": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(server, "/v1/chat/completions", {"messages": [hi], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = _post(server, "/v1/chat/completions",
              {"messages": [hi, {"role": "assistant", "content": None}, hi], "max_tokens": 2})
    assert r.status_code == 200, r.text
    # Starlette's own errors in OpenAI's shape too
    for r, status in ((_post(server, "/v1/nope", {}), 404),
                      (httpx.get(server["url"] + "/v1/completions",
                                 headers={"Authorization": f"Bearer {KEY}"}), 405)):
        assert r.status_code == status and set(r.json()["error"]) == \
            {"message", "type", "param", "code"} and r.json()["error"]["message"], r.text
    r = httpx.delete(server["url"] + "/v1/prewarm/doc?model=gpt-4",
                     headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "word " * CONTEXT}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


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


def test_disconnect_without_streaming_frees_the_slot(server):
    """A client that gives up on a non-streamed answer cancels it: its slot is free
    within about a second (the handler looks on a clock; it used to look only when
    no token had come for a second, so a request kept generating to max_tokens)."""
    before = _metrics(server)
    body = {"prompt": "Tell me a long story.", "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", body, timeout=httpx.Timeout(120, read=4))
    deadline = time.monotonic() + 5
    while _metrics(server)["hisparse:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.1)
    key = 'hisparse:request_success_total{finished_reason="abort"}'
    assert _metrics(server).get(key, 0) == before.get(key, 0) + 1


def test_traffic_records_what_was_accepted_as_sent(server):
    """--record-traffic writes an accepted request with what its client set (so that
    a replay sends the same request), and nothing for a refused one."""
    traffic = server["log"].with_name("traffic.jsonl")
    body = {"prompt": FRANCE + " (recorded)", "max_tokens": 3, "temperature": 0.5,
            "top_p": 0.9, "seed": 7, "stop": ["\n\n"], "n": 2}
    assert _post(server, "/v1/completions", body).status_code == 200
    refused = {"prompt": FRANCE + " (refused)", "max_tokens": 0}
    assert _post(server, "/v1/completions", refused).status_code == 400
    rows = [json.loads(line) for line in traffic.read_text().splitlines()]
    row = next(r for r in rows if r.get("prompt") == body["prompt"])
    assert {k: row[k] for k in body} == body and row["model"] == MODEL
    assert not any(r.get("prompt") == refused["prompt"] for r in rows)


def test_streamed_logprobs_count_text_offsets_from_the_start(server):
    body = {"prompt": FRANCE, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    events = _sse(server, {**body, "stream": True}, key=KEY)
    offsets = [o for e in events if e.get("choices") and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"] and len(set(offsets)) > 1


def test_logprobs_name_each_token_once_and_hold_the_sampled_one(server, tok):
    """A byte-level token that is part of a character has no text of its own: it is
    named "bytes:\\xNN..." (OpenAI's form), so no two of a position's top_logprobs
    share a name (every such token decoded to U+FFFD, one dict key, so entries went
    missing). The sampled token is always among them (logprobs + 1 entries at most,
    as OpenAI's and vLLM's), with the model's own logprob; chat's `bytes` add up to
    the answer."""
    party = tok.encode("🎉")[0]  # the emoji's first token: 2 of its 4 bytes
    assert tok.token_bytes(party) == "🎉".encode()[:2]
    body = {"prompt": FRANCE, "max_tokens": 3, "temperature": 0, "logprobs": 2,
            "logit_bias": {str(party): 100}}
    lp = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["bytes:\\xf0\\x9f"] * 3
    for name, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 3 and top[name] == logprob < max(top.values())  # forced, unlikely
    body = {"prompt": "Emoji party: 🎉🎉 日本の首都は", "max_tokens": 12, "temperature": 1.0,
            "seed": 4, "logprobs": 20, "ignore_eos": True}
    lp = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert all(len(top) in (20, 21) and top[name] == logprob for name, logprob, top in
               zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    zero = _post(server, "/v1/completions", {**body, "logprobs": 0}).json()
    lp = zero["choices"][0]["logprobs"]  # the sampled token alone
    assert [list(top) for top in lp["top_logprobs"]] == [[n] for n in lp["tokens"]]
    chat = {"messages": [{"role": "user", "content": "Write three emoji and 日本."}],
            "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    c = _post(server, "/v1/chat/completions", chat).json()["choices"][0]
    content = c["logprobs"]["content"]
    answer = bytes(b for e in content for b in e["bytes"])
    assert answer.decode("utf-8", "replace") == c["message"]["content"]
    assert all(len(e["top_logprobs"]) == 3 and all(t["bytes"] for t in e["top_logprobs"])
               for e in content)


def test_null_is_the_default_and_other_spellings(server):
    """null is a field left out (completions' max_tokens: 16, not the context's
    room); vLLM's top_k -1 is no top-k; OpenAI's top_p 0 keeps the likeliest
    token; any 64-bit seed reproduces; the Bearer scheme in any case; one model's
    card at /v1/models/ID."""
    def complete(**kw):
        r = _post(server, "/v1/completions", {"prompt": "Once upon a time", **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
    assert complete(max_tokens=None, n=None, stream=None, echo=None, ignore_eos=True,
                    temperature=None, top_p=None, logprobs=None, stop=None)[1] == 16
    events = _sse(server, {"prompt": FRANCE, "max_tokens": 2, "stream": True,
                           "stream_options": {"include_usage": None}}, key=KEY)
    assert events[-1] == {"done": True} and all("usage" not in e for e in events[:-1])
    sampled = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    assert complete(**sampled, seed=3, top_k=-1) == complete(**sampled, seed=3)
    assert complete(**sampled, seed=3, top_p=0) == complete(max_tokens=8, temperature=0,
                                                            ignore_eos=True)
    assert complete(**sampled, seed=-5) == complete(**sampled, seed=-5) != \
        complete(**sampled, seed=-6)
    headers = {"authorization": f"bearer {KEY}"}
    assert httpx.get(server["url"] + "/v1/models", headers=headers).status_code == 200
    card = httpx.get(server["url"] + f"/v1/models/{MODEL}", headers=headers).json()
    assert card["id"] == MODEL and card["max_model_len"] == CONTEXT
    r = httpx.get(server["url"] + "/v1/models/gpt-4", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(server["url"] + "/v1/models/", headers=headers, follow_redirects=True)
    assert r.json()["object"] == "list"  # Starlette's redirect to the list, not a card


def test_big_bodies_are_refused_before_they_stall_the_server(server):
    """A body over --max-request-bytes (here the default: 4 MiB and 3 bytes for each
    of the 81 bytes of 1,024 tokens) gets a 413 whether it declares its length or
    not; a text too long for the context by its bytes alone (a token is at most 81
    bytes here) gets its 400 without being tokenized (a 20 MB prompt took 13 s to
    refuse, and stalled every stream meanwhile)."""
    big = json.dumps({"prompt": "a" * (5 << 20)}).encode()
    for content in (big, iter([big[i:i + 65536] for i in range(0, len(big), 65536)])):
        r = httpx.post(server["url"] + "/v1/completions", content=content, timeout=120,
                       headers={"Authorization": f"Bearer {KEY}",
                                "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = _post(server, "/v1/completions", {"prompt": "a" * 3_000_000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert f"your prompt has at least {-(-3_000_000 // 81)} tokens" in err["message"]
    assert _post(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 1}).status_code \
        == 200


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
    # the document's cold pages: pinned once, referenced by both requests (hits)
    assert after['hisparse:kv_cold_pool_pages{state="pinned"}'] > 0
    hit = 'hisparse:prefix_index_pages_total{result="hit"}'
    assert after[hit] - before[hit] >= 2 * 2  # each request: the sink page and >= 1 cold
    assert after['hisparse:kv_cold_pool_pages{state="used"}'] == \
        after['hisparse:kv_cold_pool_pages{state="pinned"}']  # nothing else in use
    r = httpx.delete(server["url"] + "/v1/prewarm/doc1", headers={"Authorization":
                                                                   f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["deleted"]
    r = _post(server, "/v1/completions", {**body, "prompt": question, "context_id": "doc1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "context_id"
    r = _post(server, "/v1/prewarm", {"context_id": "short", "prompt": FRANCE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------- the bounded load test

LOAD_CLIENTS = 64
LOAD_ISSUE_S = 20     # clients start new requests for this long ...
LOAD_DRAIN_S = 130    # ... and every issued one must be answered within this after (it takes ~80)
LOAD_MAX_REQUESTS = 256  # and at most this many requests in all (4 per client)
DOC = "The grass is green. The sky is blue. The sun is yellow. Water is wet. "


@dataclasses.dataclass(frozen=True)
class Job:
    """One kind of request of the load mix; each is answered the same way every
    time it is sent (greedy, or sampled with a fixed seed), so each has one
    served-alone answer. over=True: prompt + max_tokens exceed the context: a 400."""
    name: str
    prompt: object          # text, token ids, or chat messages (chat=True)
    max_tokens: int
    stream: bool = False
    chat: bool = False
    seed: int | None = None  # None: greedy
    over: bool = False


def _load_jobs(tok) -> list[Job]:
    doc = tok.encode(DOC * 120)
    assert len(doc) > CONTEXT
    return [
        Job("france", FRANCE, 6),
        Job("fib-stream", "def fibonacci(n):", 8, stream=True),
        Job("story-seeded", "Once upon a time, in a small village,", 6, seed=11),
        Job("chat", [{"role": "user", "content": "What is the capital of France?"}], 6,
            chat=True),
        Job("ids-100", doc[:100], 4),
        Job("ids-400-stream", doc[3:403], 4, stream=True),
        Job("ids-700-seeded", doc[5:705], 4, seed=5),
        Job("ids-1016-at-limit", doc[:1016], 8),                  # 1016 + 8 = 1024
        Job("ids-1020-at-limit-stream", doc[7:1027], 4, stream=True),  # 1020 + 4 = 1024
        Job("over-by-1", doc[:1000], 25, over=True),              # 1025 > 1024
        Job("over-prompt", doc[:1100], 4, over=True),
        Job("over-chat", [{"role": "user", "content": "Hi"}], CONTEXT, chat=True, over=True),
    ]


# a client's cycle: each long prompt (one or two 512-token prefill blocks) and each
# over-the-limit request once in 32, the rest short; client i starts at position i,
# so the first 64 requests are this cycle twice
LOAD_CYCLE = ["france", "fib-stream", "story-seeded", "chat", "ids-100", "over-by-1",
              "france", "story-seeded", "ids-400-stream", "fib-stream", "chat", "france",
              "ids-100", "story-seeded", "ids-1016-at-limit", "fib-stream", "chat",
              "over-prompt", "france", "story-seeded", "fib-stream", "ids-700-seeded",
              "chat", "france", "ids-100", "story-seeded", "over-chat", "fib-stream",
              "chat", "france", "ids-1020-at-limit-stream", "story-seeded"]


@pytest.fixture
def load_server(tmp_path):
    """The load test's own server: 4 slots, a 1024-token context and a queue of 48:
    52 of the 64 clients' first requests are taken, the other 12 get a 503 and come
    back after its Retry-After (a queue of 12, as the main server's, would leave 48
    clients hammering it with retries)."""
    log = tmp_path / "serve.log"
    args = ["--max-seqs", "4", "--max-context", str(CONTEXT), "--max-waiting", "48",
            "--api-key", KEY, "--price-per-hour", "2.0"]
    with running_server(args, log, START_S) as (url, proc):
        yield {"url": url, "proc": proc, "log": log}


def _ask(client, job: Job) -> dict:
    """Send `job` once; its answer as {text, finish, usage, ...}, checked to be well
    formed. Raises openai.APIStatusError on a 4xx/5xx."""
    kw = {"model": MODEL, "max_tokens": job.max_tokens}
    kw.update({"temperature": 0} if job.seed is None else
              {"temperature": 0.8, "top_p": 0.95, "seed": job.seed})
    api = client.chat.completions if job.chat else client.completions
    kw["messages" if job.chat else "prompt"] = job.prompt
    if not job.stream:
        r = api.create(**kw)
        assert r.object == ("chat.completion" if job.chat else "text_completion"), r
        assert r.id and r.model == MODEL and len(r.choices) == 1, r
        c = r.choices[0]
        text = c.message.content if job.chat else c.text
        usage, finish = r.usage, c.finish_reason
    else:
        chunks = list(api.create(**kw, stream=True, stream_options={"include_usage": True}))
        body = [c for c in chunks if c.choices]
        assert body and all(len(c.choices) == 1 for c in body), chunks
        assert all(c.choices[0].finish_reason is None for c in body[:-1]), chunks
        assert len({c.id for c in chunks}) == 1 and not chunks[-1].choices, chunks
        text = "".join((c.choices[0].delta.content or "") if job.chat else c.choices[0].text
                       for c in body)
        usage, finish = chunks[-1].usage, body[-1].choices[0].finish_reason
    assert isinstance(text, str) and finish in ("stop", "length"), (job.name, finish)
    assert 1 <= usage.completion_tokens <= job.max_tokens, (job.name, usage)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == job.max_tokens, (job.name, usage)
    return {"text": text, "finish": finish, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens}


def test_bounded_load_matches_served_alone(load_server, tok, record_property):
    """64 clients (threads, one `openai` client) issue requests for 20 s against 4
    slots and a queue of 48, a mix of greedy, seeded-sampled and streamed completions
    and chats, prompts from 5 tokens to the 1024-token context (prompt + max_tokens =
    1024 exactly), and requests over the limit. Bounded in time (no new request after
    LOAD_ISSUE_S; every issued one answered within LOAD_DRAIN_S more) and in count. No
    request is lost: each gets a well-formed answer, or a 400 (over the limit, counted
    apart), or a 503 + Retry-After that the client honours and retries. Every answer,
    greedy or seeded, equals the same request's answer served alone (computed first, one
    at a time, through the same server). Prints the throughput it held.
    """
    server = load_server
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0,
                           timeout=LOAD_ISSUE_S + LOAD_DRAIN_S)
    jobs = {j.name: j for j in _load_jobs(tok)}
    assert set(LOAD_CYCLE) == set(jobs)
    for j in jobs.values():  # the lengths are what the names say
        if isinstance(j.prompt, list) and not j.chat:
            assert (len(j.prompt) + j.max_tokens > CONTEXT) == j.over
    # served alone: each job once, one at a time
    t0 = time.monotonic()
    alone = {name: _ask(client, j) for name, j in jobs.items() if not j.over}
    alone_s = time.monotonic() - t0
    for name, j in jobs.items():
        if isinstance(j.prompt, list) and not j.chat and not j.over:
            assert alone[name]["prompt_tokens"] == len(j.prompt)
    before = _metrics(server)

    start = time.monotonic()
    issue_until, answer_until = start + LOAD_ISSUE_S, start + LOAD_ISSUE_S + LOAD_DRAIN_S
    lock = threading.Lock()
    issued = itertools.count()
    results = []  # (job name, answer, 503 retries, seconds)
    refused, lost = [], []

    def client_loop(i: int):
        k = 0
        while time.monotonic() < issue_until:
            with lock:
                if next(issued) >= LOAD_MAX_REQUESTS:
                    return
            job = jobs[LOAD_CYCLE[(i + 5 * k) % len(LOAD_CYCLE)]]
            k += 1
            t, retries = time.monotonic(), 0
            while True:
                try:
                    answer = _ask(client, job)
                except openai.APIStatusError as e:
                    if e.status_code == 503 and time.monotonic() < answer_until:
                        retries += 1  # honour Retry-After (jittered, so 48 don't stampede)
                        time.sleep(float(e.response.headers["retry-after"]) *
                                   random.uniform(1.0, 2.0))
                        continue
                    err = e.response.json()["error"]
                    with lock:
                        (refused if e.status_code == 400 and job.over else lost).append(
                            (job.name, e.status_code, err))
                    break
                except Exception as e:  # noqa: BLE001 (a lost request, reported below)
                    with lock:
                        lost.append((job.name, type(e).__name__, str(e)[:300]))
                    break
                with lock:
                    results.append((job.name, answer, retries, time.monotonic() - t))
                break

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True)
               for i in range(LOAD_CLIENTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, answer_until + 30 - time.monotonic()))
    wall = time.monotonic() - start
    assert not any(th.is_alive() for th in threads), "a client did not finish in time"
    after = _metrics(server)

    n_issued = len(results) + len(refused) + len(lost)
    tokens = sum(a["completion_tokens"] for _, a, _, _ in results)
    retries = sum(r for _, _, r, _ in results)
    by_kind = collections.Counter(name for name, *_ in results)
    e2e = sorted(s for *_, s in results)
    batched = int(after.get("hisparse:prefill_batched_prompts_total", 0)
                  - before.get("hisparse:prefill_batched_prompts_total", 0))
    line = (f"load: {LOAD_CLIENTS} clients, {wall:.1f} s ({LOAD_ISSUE_S} s issuing), "
            f"{n_issued} requests: {len(results)} answered, {len(refused)} over the limit "
            f"(400), {len(lost)} lost; {retries} 503 + Retry-After retries; "
            f"{len(results) / wall:.2f} req/s, {tokens / wall:.2f} output tok/s "
            f"({tokens} tokens); latency median {e2e[len(e2e) // 2]:.1f} s, max "
            f"{e2e[-1]:.1f} s; served alone first: {alone_s:.1f} s for {len(alone)} requests; "
            f"{batched} prompts prefilled in batches")
    print("\n" + line)
    record_property("load", line)
    assert not lost, lost[:5]
    assert retries >= LOAD_CLIENTS - 4 - 48  # the first wave overflowed the queue
    # a prompt that fills the context is the prompt's fault, else max_tokens'
    assert all(err["code"] == "context_length_exceeded" and err["param"] ==
               ("prompt" if name == "over-prompt" else "max_tokens")
               for name, _, err in refused), refused[:3]
    assert refused and all(jobs[name].over for name, *_ in refused)
    # every kind ran under load, and each answer is the one served alone
    assert set(by_kind) == set(alone), by_kind
    for name, answer, _, _ in results:
        assert answer == alone[name], (name, answer, alone[name])
    # the server's own counters agree, and it is idle again
    done = sum(after.get(f'hisparse:request_success_total{{finished_reason="{r}"}}', 0) -
               before.get(f'hisparse:request_success_total{{finished_reason="{r}"}}', 0)
               for r in ("stop", "length"))
    assert done == len(results)
    assert after["hisparse:generation_tokens_total"] - \
        before["hisparse:generation_tokens_total"] == tokens
    rejected = 'hisparse:request_rejected_total{status="503"}'
    assert after.get(rejected, 0) - before.get(rejected, 0) == retries
    assert after["hisparse:num_requests_running"] == after["hisparse:num_requests_waiting"] == 0
    assert after["hisparse:kv_cache_usage_perc"] == 0
    assert after['hisparse:kv_cold_pool_pages{state="used"}'] == 0
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
    # the lines' own fields are sent: the second request stops at its "." again
    assert rows[1]["stop"] == ["."] and rows[1]["temperature"] == 0
    again = _post(server, "/v1/completions", {k: v for k, v in rows[1].items()
                                              if k != "timestamp"}).json()
    assert row["completed"] == 3
    assert row["output_tokens"] == 8 + again["usage"]["completion_tokens"] + 8 < 24


def test_queue_full_answers_503_with_retry_after(server):
    """4 slots and 12 waiting: of 24 requests sent at once, some are turned away
    at once with 503 and Retry-After; the accepted ones all complete."""
    body = {"prompt": FRANCE + " (queued)", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        rs = list(pool.map(lambda _: _post(server, "/v1/completions", body), range(24),
                           timeout=300))
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 503} and codes.count(200) >= 16, codes
    # --record-traffic wrote the accepted ones only (it wrote all 24 before)
    traffic = server["log"].with_name("traffic.jsonl").read_text().splitlines()
    assert sum(json.loads(x).get("prompt") == body["prompt"] for x in traffic) == \
        codes.count(200)
    busy = next(r for r in rs if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in rs if r.status_code == 200)


# ---------------------------------------------------------------- faults: the pool, NaN

FAULT_POOL = 8  # cold pages per layer: a 546-token sequence takes 6 (cold from 465 tokens on)


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory):
    """A second server: 2 slots over a cold page pool of FAULT_POOL pages per layer
    (two 546-token sequences need 12), with --fault-injection (a request's
    fault_nan_kv_after turns its K/V to NaN)."""
    log = tmp_path_factory.mktemp("fault") / "serve.log"
    args = ["--max-seqs", "2", "--max-context", str(CONTEXT), "--kv-pool-pages",
            str(FAULT_POOL), "--max-waiting", "4", "--fault-injection"]
    with running_server(args, log, START_S) as (url, proc):
        assert f"cold page pool: {FAULT_POOL} pages per layer" in log.read_text()
        yield {"url": url, "proc": proc, "log": log}


def _sse(server, body, key=None) -> list[dict]:
    """A streamed completion's events (the JSON of each `data:` line, "[DONE]" as
    {"done": True})."""
    out = []
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append({"done": True} if data == "[DONE]" else json.loads(data))
    return out


def _streamed(events) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, the error event's error or None) of `_sse`'s events."""
    assert events[-1] == {"done": True}, events[-3:]
    body = [e for e in events if e.get("choices")]
    err = next((e["error"] for e in events if "error" in e), None)
    return ("".join(e["choices"][0]["text"] for e in body),
            body[-1]["choices"][0]["finish_reason"], err)


def test_pool_running_out_never_corrupts_another_stream(fault_server, tok):
    """Two streams whose prompt + max_tokens need 6 cold pages each, over a pool of
    8: admission reserves a request's whole need, so the second waits (queued, with
    a slot free) while the first streams, then runs; neither ever finds the pool
    empty (without the reservation both prefills take 4 pages each, and the first
    decode step to make a 9th page cold would be handed a page the other holds).
    Both streams equal their served-alone output; a request that needs more than
    the whole pool gets a 400 at once; afterwards no page is in use."""
    doc = tok.encode(DOC * 60)
    bodies = [{"prompt": doc[i:i + 526], "max_tokens": 20, "temperature": 0,
               "ignore_eos": True, "stream": True} for i in (0, 7)]
    assert all(len(b["prompt"]) == 526 for b in bodies)
    alone = [_streamed(_sse(fault_server, b)) for b in bodies]
    assert all(a[1] == "length" and a[2] is None for a in alone)
    assert alone[0][0] != alone[1][0]
    total = FAULT_POOL * 30  # the metric sums the 30 layers

    samples, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            m = _metrics(fault_server)
            samples.append((m["hisparse:num_requests_running"],
                            m["hisparse:num_requests_waiting"],
                            m['hisparse:kv_cold_pool_pages{state="used"}'],
                            m['hisparse:kv_cold_pool_pages{state="reserved"}']))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda b: _streamed(_sse(fault_server, b)), bodies,
                                     timeout=300))
    finally:
        stop.set()
        watcher.join()
    assert together == alone
    assert (1, 1) in [(r, w) for r, w, _, _ in samples], samples  # one waited for pages
    assert (2, 0) not in [(r, w) for r, w, _, _ in samples], samples  # never both at once
    assert 4 * 30 <= max(u for *_, u, _ in samples) <= 6 * 30  # one sequence's pages at most
    assert max(u + r for *_, u, r in samples) == 6 * 30  # in use + what it may still take
    # more than the whole pool: refused at once, with the reason
    r = _post(fault_server, "/v1/completions", {"prompt": doc[:590], "max_tokens": 200},
              key=None)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_pool_too_small" and err["param"] == "max_tokens"
    assert f"the pool holds {FAULT_POOL}" in err["message"]
    after = _metrics(fault_server)
    assert after['hisparse:kv_cold_pool_pages{state="used"}'] == 0
    assert after['hisparse:kv_cold_pool_pages{state="reserved"}'] == 0
    assert after['hisparse:kv_cold_pool_pages{state="total"}'] == total
    assert after["hisparse:kv_cold_pool_usage_perc"] == 0
    assert after["hisparse:num_requests_running"] == after["hisparse:num_requests_waiting"] == 0


def test_nan_in_one_request_never_reaches_another(fault_server):
    """A request whose K/V turn NaN after 3 tokens (fault injection) decodes in the
    same batch as a healthy stream: the poisoned one is stopped with a clear error
    (streamed: an error event, then finish_reason "abort"; not streamed: a 500 with
    the message) before any NaN-derived token is sent, and the healthy stream's
    output is exactly its served-alone output. Afterwards nothing is poisoned and
    the slots and pages are free."""
    healthy = {"prompt": FRANCE, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
               "stream": True}
    sick = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "fault_nan_kv_after": 3}
    ref = _streamed(_sse(fault_server, healthy))
    plain = {k: v for k, v in sick.items() if k != "fault_nan_kv_after"}
    sick_alone = _post(fault_server, "/v1/completions", plain, key=None).json()
    sick_text = sick_alone["choices"][0]["text"]
    before = _metrics(fault_server)
    errors = 'hisparse:request_success_total{finished_reason="error"}'

    def alongside(send_sick):
        """The healthy stream, and once it is decoding, `send_sick()` next to it."""
        got = {}
        start = _metrics(fault_server)["hisparse:generation_tokens_total"]
        th = threading.Thread(target=lambda: got.update(
            healthy=_streamed(_sse(fault_server, healthy))))
        th.start()
        deadline = time.monotonic() + 120
        while _metrics(fault_server)["hisparse:generation_tokens_total"] < start + 2:
            assert time.monotonic() < deadline, "the healthy stream did not start"
            time.sleep(0.05)
        got["sick"] = send_sick()
        th.join(300)
        assert not th.is_alive()
        return got

    got = alongside(lambda: _streamed(_sse(fault_server, {**sick, "stream": True})))
    assert got["healthy"] == ref
    text, finish, err = got["sick"]
    assert finish == "abort" and err is not None and "non-finite" in err["message"], got
    assert text and sick_text.startswith(text)  # its first 3 tokens, then nothing
    got = alongside(lambda: _post(fault_server, "/v1/completions", sick, key=None))
    assert got["healthy"] == ref
    r = got["sick"]
    assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"], r.text
    after = _metrics(fault_server)
    assert after[errors] - before.get(errors, 0) == 2
    assert after["hisparse:poisoned_sequences"] == 0
    assert after['hisparse:kv_cold_pool_pages{state="used"}'] == 0
    assert after["hisparse:num_requests_running"] == 0
    assert "fault injection is ON" in fault_server["log"].read_text()


def test_bench_serve_counts_a_stream_that_failed_as_failed(fault_server, tmp_path, capsys):
    """A stream that ends in an error event after its 200 (here its K/V turn NaN)
    is a failed request in `bench serve`'s figures, not a completed one (it was).
    The replay sends each line's own fields, fault_nan_kv_after among them."""
    from hisparse_jax.cli import main
    lines = [{"prompt": FRANCE, "max_tokens": 6, "ignore_eos": True},
             {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True,
              "fault_nan_kv_after": 3}]
    path = tmp_path / "replay lines.jsonl"  # a space: the row's command quotes it
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    main(["bench", "serve", "--base-url", fault_server["url"], "--tokenizer", "none",
          "--dataset", "replay", "--dataset-path", str(path), "--warmup", "0",
          "--temperature", "0", "--no-progress", "--json", "-"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["requests"] == 2 and row["completed"] == 1 and row["failed"] == 1, row
    assert row["output_tokens"] == 6 and any("non-finite" in e for e in row["errors"])
    assert str(path) in shlex.split(row["command"])  # the command runs again as written


def test_fault_injection_is_off_by_default(server):
    r = _post(server, "/v1/completions", {"prompt": FRANCE, "fault_nan_kv_after": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "fault_nan_kv_after"


def test_sigterm_finishes_running_requests_and_exits_0(server):
    """SIGTERM: the server stops admitting; a stream that ends within
    --shutdown-timeout (5 s here) runs to its end, a longer one is ended at the
    deadline with finish_reason "abort" (it used to be cut mid-body by uvicorn);
    both close with [DONE], and the process exits 0."""
    proc = server["proc"]
    first = threading.Barrier(3, timeout=300)
    got: dict[str, list | BaseException] = {}

    def read(name, max_tokens):
        body = {"prompt": FRANCE, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server["url"] + "/v1/completions", json=body,
                              timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as r:
                lines = r.iter_lines()
                head = next(lines)
                first.wait()
                got[name] = [head, *lines]
        except BaseException as e:  # noqa: BLE001 (the test asserts on it)
            got[name] = e
            first.abort()

    threads = [threading.Thread(target=read, args=("short", 12)),
               threading.Thread(target=read, args=("long", CONTEXT - 64))]
    for t in threads:
        t.start()
    first.wait()
    os.kill(proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    for name, reason in (("short", "length"), ("long", "abort")):
        lines = got[name]
        assert isinstance(lines, list), lines
        data = [x[len("data: "):] for x in lines if x.startswith("data: ")]
        assert data[-1] == "[DONE]", (name, data[-3:])
        reasons = [c["finish_reason"] for c in map(json.loads, data[:-1])
                   for c in c["choices"] if c["finish_reason"]]
        assert reasons == [reason], (name, reasons)
    assert proc.wait(timeout=60) == 0
    log = server["log"].read_text()
    assert "stopped" in log and "CancelledError" not in log and "exceeded" not in log
