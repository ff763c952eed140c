"""`hisparse serve --offload`: a device budget (--kv-cache-memory) that does not hold
one sequence of the context serves it with the cold pages in host memory, the
answers equal the all-resident engine's, and /metrics shows the offload counters."""

from __future__ import annotations

import re
import types

import httpx
import numpy as np
import pytest
from models_fixtures import smollm2

from hisparse_jax.cli.serve import plan_slots
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.generate import stop_ids
from tests.helpers import running_server

CONTEXT, BUDGET, SEQS = 2048, 64, 1
START_S = 600


@pytest.fixture(scope="module")
def model():
    return smollm2()


def _plan(mc, memory, offload):
    cfg = types.SimpleNamespace(attention="hisparse", max_seqs=8,
                                kv_cache_memory=memory, offload=offload)
    return plan_slots(mc, CONTEXT, cfg, BUDGET)


def _budget(mc) -> int:
    """Device bytes for SEQS offloaded sequences: fewer than one all-resident one
    (a sequence's bytes, from how many a TiB holds)."""
    one_resident, one_offloaded = ((1 << 40) // _plan(mc, 1 << 40, o)[0]
                                   for o in (False, True))
    memory = SEQS * one_offloaded
    assert memory < one_resident, "offload must hold more sequences per byte"
    return memory


def test_the_planner_fits_a_context_only_when_offloaded(model):
    m, _ = model
    memory = _budget(m.cfg)
    with pytest.raises(ValueError, match="not one sequence of 2048 tokens fits"):
        _plan(m.cfg, memory, offload=False)
    seqs, line = _plan(m.cfg, memory, offload=True)
    assert seqs == SEQS
    assert re.search(r"host [\d.]+ MiB\), 1 sequences of 2048 tokens", line)


def test_offload_server_answers_as_all_resident(model, tmp_path):
    """A ~1,500-token prompt (its cold pages 20x the selection budget) on a server
    whose device budget holds no all-resident sequence: greedy answers equal the
    all-resident engine's; the offload counters move."""
    m, tok = model
    text = ("The lighthouse keeper wrote down the weather, the ships that passed and the "
            "birds he saw each morning, and on the last page of the third book he wrote "
            "that the blue door key was under the second stone. ")
    ids = tok.encode(text * 45)[:1500]
    alone = Engine(m, max_seqs=SEQS, max_context=CONTEXT, budget_tokens=BUDGET)
    want, eos = [alone.prefill(0, np.asarray(ids, np.int32))], stop_ids(m, tok)
    while len(want) < 16 and want[-1] not in eos:
        want.append(int(alone.decode_step()[0]))
    want = [t for t in want if t not in eos]
    log = tmp_path / "serve.log"
    args = ["--offload", "--kv-cache-memory", str(_budget(m.cfg)), "--max-context",
            str(CONTEXT), "--budget-tokens", str(BUDGET)]
    with running_server(args, log, START_S) as (url, _):
        assert re.search(r"1 sequences of 2048 tokens", log.read_text())
        assert "offloaded to host memory" in log.read_text()
        body = {"model": "smollm2-135m", "prompt": ids, "max_tokens": 16, "temperature": 0}
        for _ in range(2):  # the second on a slot the first left: its pages were forgotten
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["text"]
            assert got == tok.decode(want), (got, tok.decode(want))
        metrics = httpx.get(url + "/metrics").text
    value = lambda name: float(re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", metrics,
                                         re.MULTILINE).group(1))
    series = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^hisparse:offload_cold_pages_total\{.*result="(\w+)"\} (\S+)$', metrics, re.MULTILINE)}
    assert series["miss"] > 0 and series["hit"] > series["miss"]
    assert value("hisparse:offload_host_to_device_bytes_total") > 0
    assert 0 < value("hisparse:offload_resident_hit_rate") < 1


def test_offload_needs_hisparse():
    from hisparse_jax.serving.app import ServeConfig
    with pytest.raises(ValueError, match="only attention='hisparse'"):
        ServeConfig(attention="dense", offload=True)
    with pytest.raises(ValueError, match="offload_policy="):
        ServeConfig(offload=True, offload_policy="fifo")
    with pytest.raises(ValueError, match="offload_policy: only with offload"):
        ServeConfig(offload_policy="lru")
    with pytest.raises(ValueError, match="implementation='triton': choose from xla, pallas, cpu"):
        ServeConfig(implementation="triton")


@pytest.mark.parametrize("fields, message", [
    ({"api_key": ""}, "api_key must be printable ASCII"),
    ({"api_key": "sk key"}, "api_key must be printable ASCII"),
    ({"api_key": "sk-clé"}, "api_key must be printable ASCII"),  # headers arrive as latin-1
    ({"shutdown_timeout": 1e10}, "must be under a day"),  # threading's waits overflow
    ({"shutdown_timeout": -1}, "shutdown_timeout must be >= 0"),
    ({"max_request_bytes": 100}, "max_request_bytes must be an int >= 1024"),
])
def test_serve_config_refuses(fields, message):
    from hisparse_jax.serving.app import ServeConfig
    with pytest.raises(ValueError, match=message):
        ServeConfig(**fields)


def test_offload_series_only_for_an_offloaded_model():
    from prometheus_client import generate_latest

    from hisparse_jax.serving.metrics import Metrics
    metrics = Metrics()
    metrics.bind("plain")
    metrics.bind("offloaded", offload=True)
    text = generate_latest(metrics.registry).decode()
    samples = [x for x in text.splitlines() if x.startswith("hisparse:offload_")]
    assert samples and all('model_name="offloaded"' in x for x in samples)
