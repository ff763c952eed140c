"""The `hisparse` command line: eval on user npz files, bench attention, demo."""

import json

import numpy as np
import pytest

from hisparse_jax.cli import main
from hisparse_jax.harness.workloads import make_workload
from tests.helpers import cli_error

JSON_KEYS = {"recall_mean", "recall_p5", "rel_error_mean", "rel_error_p95",
             "selection_error_mean", "top10_recall", "attended_fraction",
             "device_bytes_per_token", "capacity_vs_bf16", "unsampled_selection_error_mean"}


def _npz(tmp_path, d, dtype=np.float16, s=3000, name="qkv.npz"):
    w = make_workload(context=s, num_kv_heads=2, gqa_group=2, head_dim=d, num_queries=3, seed=d)
    path = tmp_path / name
    np.savez(path, q=w.q.astype(dtype), k=w.k.astype(dtype), v=w.v.astype(dtype))
    return path


@pytest.mark.parametrize("d,dtype", [(32, np.float16), (64, np.float32), (128, np.float16),
                                     (96, np.float32)])  # 96: Phi-3's head_dim
def test_eval_json(tmp_path, capsys, d, dtype):
    main(["eval", "--qkv", str(_npz(tmp_path, d, dtype)), "--budget-tokens", "256", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(row)
    assert 0.0 < row["recall_mean"] <= 1.0 + 1e-6
    assert row["capacity_vs_bf16"] > 1.0
    run = row["run"]  # what produced it
    assert run["command"].startswith("hisparse eval --qkv ") and run["budget_tokens"] == 256
    assert run["preset"] == "default" and run["implementation"] in ("xla", "cpu", "pallas")


def test_eval_budget_all_isolates_quantization(tmp_path, capsys):
    main(["eval", "--qkv", str(_npz(tmp_path, 64)), "--budget-tokens", "all", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert row["selection_error_mean"] == pytest.approx(0.0, abs=1e-6)
    assert row["recall_mean"] == pytest.approx(1.0, abs=1e-5)
    assert row["rel_error_mean"] < 0.1


def test_eval_without_tail_sample(tmp_path, capsys):
    path = str(_npz(tmp_path, 64))
    # Without the re-rank's sample of rejected candidates either, nothing is estimated.
    main(["eval", "--qkv", path, "--budget-tokens", "256", "--tail-sample-pages", "0",
          "--rerank-multiple", "1", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert row["selection_error_mean"] == row["unsampled_selection_error_mean"] > 0
    assert "--tail-sample-pages" in cli_error(capsys, ["eval", "--qkv", path,
                                                       "--tail-sample-pages", "-2"])
    assert "--rerank-multiple" in cli_error(capsys, ["eval", "--qkv", path,
                                                     "--rerank-multiple", "0.5"])


def test_eval_table(tmp_path, capsys):
    main(["eval", "--qkv", str(_npz(tmp_path, 64))])
    assert "recall_mean" in capsys.readouterr().out


def _arrays(q_shape=(2, 4, 64), k_shape=(100, 2, 64), q_dtype=np.float32, k_fill=0.0,
            with_v=True):
    out = {"q": np.zeros(q_shape, q_dtype), "k": np.full(k_shape, k_fill, np.float32)}
    if with_v:
        out["v"] = np.zeros(k_shape, np.float32)
    return out


@pytest.mark.parametrize("arrays,msg", [
    (_arrays(with_v=False), "lacks"),
    (_arrays(q_dtype=np.int32), "float16 or float32"),
    (_arrays(q_shape=(2, 3, 64)), "multiple"),
    (_arrays(k_fill=np.nan), "finite"),
    (_arrays(q_shape=(2, 4, 63), k_shape=(100, 2, 63)), "head_dim"),
])
def test_eval_bad_input(tmp_path, capsys, arrays, msg):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    assert msg in cli_error(capsys, ["eval", "--qkv", str(path)])


def test_eval_missing_file(tmp_path, capsys):
    assert "cannot read" in cli_error(capsys, ["eval", "--qkv", str(tmp_path / "nope.npz")])


def test_bad_budget(tmp_path, capsys):
    assert "--budget-tokens" in cli_error(capsys, ["eval", "--qkv", str(_npz(tmp_path, 64)),
                                                   "--budget-tokens", "lots"])


def test_bench_attention_json(capsys):
    main(["bench", "attention", "--context", "8192", "--repeats", "3", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert row["dense_ms"] > 0 and row["hisparse_ms"] > 0
    assert row["speedup"] == pytest.approx(row["dense_ms"] / row["hisparse_ms"])
    assert "bench attention" in row["command"]
    assert row["tail_sample_pages"] == 32


def test_bench_attention_bad_tail_sample(capsys):
    assert "--tail-sample-pages" in cli_error(capsys, ["bench", "attention", "--context", "8192",
                                                       "--tail-sample-pages", "-1"])


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_bench_scheduler_bad_sticky_nats(capsys, bad):
    assert "--sticky-nats" in cli_error(capsys, ["bench", "scheduler", "--sticky-nats", bad])


def test_demo_small(capsys):
    main(["demo", "--synthetic", "--context", "8192"])
    out = capsys.readouterr().out
    assert "retrieval" in out and "capacity at 1M tokens" in out and "faster" in out


def test_capacity_json(capsys):
    main(["capacity", "--model", "llama3-8b", "--context", "1048576", "--device-memory", "141GB",
          "--json"])
    row = json.loads(capsys.readouterr().out)
    text = json.dumps(row)
    assert "capacity" in text


def test_capacity_bad_size(capsys):
    assert "--device-memory lots" in cli_error(capsys, ["capacity", "--device-memory", "lots"])


def test_eval_heads_and_oracle_budgets(tmp_path, capsys):
    path = str(_npz(tmp_path, 64))
    main(["eval", "--qkv", path, "--budget-tokens", "256", "--json"])
    every_head = json.loads(capsys.readouterr().out)
    main(["eval", "--qkv", path, "--budget-tokens", "256", "--heads", "0,1",
          "--oracle-budgets", "128,256,1024,4096", "--json"])
    row = json.loads(capsys.readouterr().out)
    curve = [row["oracle_recall_at_budget"][b] for b in ("128", "256", "1024", "4096")]
    assert curve == sorted(curve) and curve[0] < curve[-1]  # more budget, more recall
    assert curve[1] == pytest.approx(row["oracle_recall_mean"], abs=1e-9)  # the budget in use
    assert curve[-1] == pytest.approx(1.0, abs=1e-5)  # 4096 tokens hold all 3000
    # Heads 0 and 1 are sink heads (kinds cycle per KV head): not every head's mean.
    assert row["recall_mean"] != pytest.approx(every_head["recall_mean"], abs=1e-4)
    main(["eval", "--qkv", path, "--oracle-budgets", "512"])
    assert "oracle_recall at 512 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--heads", "4"), ("--heads", "-1"),
                                        ("--heads", "a,b"), ("--oracle-budgets", "0")])
def test_eval_bad_heads_or_oracle_budgets(tmp_path, capsys, flag, value):
    assert flag in cli_error(capsys, ["eval", "--qkv", str(_npz(tmp_path, 64)), flag, value])


def test_eval_implementation(tmp_path, monkeypatch, capsys):
    """Pallas needs power-of-two head_dims: asked for with 96 it is refused by name
    before anything runs; auto picks XLA for 96 even on a GPU; xla runs anywhere."""
    path = str(_npz(tmp_path, 96, np.float32))
    assert "head_dim must be a power of two" in cli_error(
        capsys, ["eval", "--qkv", path, "--implementation", "pallas"])
    main(["eval", "--qkv", path, "--implementation", "xla", "--budget-tokens", "256", "--json"])
    assert "(xla kernels)" in capsys.readouterr().err
    monkeypatch.setattr("jax.default_backend", lambda: "gpu")
    main(["eval", "--qkv", path, "--budget-tokens", "256", "--json"])
    assert "(xla kernels)" in capsys.readouterr().err
