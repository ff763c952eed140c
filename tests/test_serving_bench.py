"""`hisparse bench serve` against a stand-in server whose timings and faults are
known (tests/fake_openai_server.py, a real process on a loopback port): what it
measures, what it counts as failed, and how a run ends. Against our own server it
is tested in test_serving_api.py."""

from __future__ import annotations

import json
import time

import pytest
from helpers import cli_error, interrupted_cli, running_server

from hisparse_jax.cli import main

BASE = ["bench", "serve", "--tokenizer", "none", "--input-len", "8", "--no-progress",
        "--warmup", "0"]


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    log = tmp_path_factory.mktemp("fake") / "fake.log"
    with running_server([], log, 60, module="tests.fake_openai_server") as (url, _):
        yield url


def strict_json(line: str) -> dict:
    """json.loads that refuses Infinity and NaN, as JSON itself does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def run(capsys, *argv) -> dict:
    main([*BASE, *argv, "--json", "-"])
    return strict_json(capsys.readouterr().out.strip().splitlines()[-1])


def test_timings_of_a_known_stream(fake, capsys):
    """First chunk after 300 ms, then one every 60 ms, 8 tokens: TTFT, ITL and TPOT
    as sent (a loaded 2-core machine adds its own delays: bounds, not equality;
    an interval can also come out a little under 60 ms where the chunk before it
    arrived late: a median of 59.89 ms was seen); the default rate is written as
    the string "inf" (JSON has no Infinity)."""
    row = run(capsys, "--base-url", fake, "--model", "ok:ttft=0.3:itl=0.06",
              "--num-prompts", "2", "--output-len", "8")
    assert row["completed"] == 2 and row["request_rate"] == "inf"
    assert row["token_counts"] == "usage" and row["output_tokens"] == 16
    assert 300 <= row["ttft_ms"]["median"] < 600
    for k in ("itl_ms", "tpot_ms"):
        assert 54 <= row[k]["median"] < 120, (k, row[k])  # within 10% below


def test_a_server_without_usage_is_counted_in_chunks_and_says_so(fake, capsys):
    """4 tokens a chunk and no usage: 8 chunks are counted (the server's 32 tokens
    cannot be seen), the prompt's 8 tokens come from the client's own ids, and the
    row says where the counts came from."""
    row = run(capsys, "--base-url", fake, "--model", "ok:batch=4:usage=0",
              "--num-prompts", "2", "--output-len", "32")
    assert row["completed"] == 2 and row["output_tokens"] == 2 * 8
    assert row["prompt_tokens"] == 2 * 8
    assert "no usage" in row["token_counts"]


def test_a_run_where_nothing_completes_exits_1(fake, capsys):
    """Every request refused with a 500: the report still comes (each reason once,
    with its count), then exit 1 and a line that names the reason."""
    with pytest.raises(SystemExit) as e:
        main([*BASE, "--base-url", fake + "/v1/", "--model", "http500", "--num-prompts", "3",
              "--output-len", "4", "--json", "-"])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    row = strict_json(out.strip().splitlines()[-1])
    assert row["completed"] == 0 and row["errors"] == {'HTTP 500: {"error":{"message":"boom"}}': 3}
    assert err.strip() == ('hisparse bench serve: no request completed '
                           '(HTTP 500: {"error":{"message":"boom"}})')


def test_an_error_event_as_a_plain_string_fails_its_request(fake, capsys):
    """An error event whose value is a string, not an object, is a failed request
    with that message (it was an AttributeError's)."""
    with pytest.raises(SystemExit):
        main([*BASE, "--base-url", fake, "--model", "errstr", "--num-prompts", "2",
              "--output-len", "4", "--json", "-"])
    row = strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["failed"] == 2 and row["errors"] == {"the pool ran out": 2}


def test_the_timeout_is_for_the_whole_request(fake, capsys):
    """Each read comes within 0.3 s, but the stream takes about 2 s: a 1 s --timeout
    fails it (it used to bound each read only)."""
    with pytest.raises(SystemExit):
        main([*BASE, "--base-url", fake, "--model", "ok:itl=0.3", "--num-prompts", "1",
              "--output-len", "8", "--timeout", "1", "--json", "-"])
    row = strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["errors"] == {"no end within --timeout 1 s": 1}


def test_replay_sorts_its_lines_and_warms_up_on_copies(fake, tmp_path, capsys):
    """Lines out of time order are sent in time order; the warm-up repeats the first
    line, and every line is measured."""
    import httpx
    path = tmp_path / "traffic.jsonl"
    stamps = [3.0, 1.0, 2.0, 1.5]
    path.write_text("".join(json.dumps({"timestamp": t, "prompt": f"line {i}", "max_tokens": 2})
                            + "\n" for i, t in enumerate(stamps)))
    before = len(httpx.get(fake + "/requests").json())
    row = run(capsys, "--base-url", fake, "--model", "ok", "--dataset", "replay",
              "--dataset-path", str(path), "--replay-speed", "20", "--warmup", "1")
    assert row["requests"] == row["completed"] == 4
    sent = [b["prompt"] for b in httpx.get(fake + "/requests").json()[before:]]
    assert sent == ["line 1", "line 1", "line 3", "line 2", "line 0"]


@pytest.mark.parametrize("rate", ["inf", "0.5"])
def test_ctrl_c_reports_what_ended_and_exits_130(fake, tmp_path, rate):
    """SIGINT mid-run, while the requests stream (rate inf) or while the next one
    waits to be sent (0.5/s): the figures of the requests that had ended (none),
    no request counted as failed by its cut connection, one line on stderr, exit
    130, no traceback."""
    import httpx
    out = tmp_path / "rows.jsonl"
    before = len(httpx.get(fake + "/requests").json())
    def first_request_sent(proc):
        deadline = time.monotonic() + 120
        while len(httpx.get(fake + "/requests").json()) == before:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1)
    code, stdout, stderr = interrupted_cli(
        [*BASE, "--base-url", fake, "--model", "ok:itl=0.5", "--num-prompts", "3",
         "--output-len", "40", "--request-rate", rate, "--json", str(out)], first_request_sent)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "interrupted, 0 of 3 requests had ended" in stderr
    row = strict_json(out.read_text().splitlines()[-1])
    assert row["interrupted"] is True and row["not_ended"] == 3 and row["failed"] == 0
    assert "interrupted" in stdout


@pytest.mark.parametrize("argv, message", [
    (["--dataset-path", "x.jsonl"], "--dataset-path is for --dataset replay, not random"),
    (["--dataset", "lognormal-bimodal", "--long-fraction", "1.5"],
     "--long-fraction 1.5: a share, at most 1"),
    (["--slo", "ttft_ms=100,ttft_ms=1"], "ttft_ms is given twice"),
    (["--slo", "ttft_ms=inf"], "ttft_ms must be > 0 and finite"),
    (["--endpoint", "chat"], "--endpoint chat sends text: it needs a --tokenizer"),
    (["--json", "/nonexistent/dir/rows.jsonl"], "--json /nonexistent/dir/rows.jsonl:"),
])
def test_bad_flags_are_one_line(capsys, argv, message):
    assert message in cli_error(capsys, [*BASE, "--model", "m", *argv])


@pytest.mark.parametrize("lines, message", [
    ([{"timestamp": 1, "prompt": "a"}, {"prompt": "b"}], "1 of 2 lines have a timestamp"),
    ([{"timestamp": float("inf"), "prompt": "a"}], ":1: not a request line (timestamp inf)"),
    ([{"prompt": None}], ":1: not a request line (an empty or missing prompt"),
    ([{"messages": []}], ":1: not a request line (an empty or missing prompt"),
])
def test_bad_replay_lines_are_one_line(capsys, tmp_path, lines, message):
    path = tmp_path / "traffic.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert message in cli_error(capsys, [*BASE, "--model", "m", "--dataset", "replay",
                                         "--dataset-path", str(path)])


def test_request_rate_inf_is_the_default_spelled_out():
    import argparse
    import math

    from hisparse_jax.cli.bench_serve import add_arguments
    p = add_arguments(argparse.ArgumentParser())
    assert p.parse_args(["--request-rate", "inf"]).request_rate == math.inf
    assert p.parse_args([]).request_rate == math.inf
