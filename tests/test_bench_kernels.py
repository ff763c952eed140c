"""`hisparse bench kernels`: the ci case end to end (Pallas in interpret mode on a
CPU), JSON rows, and clean refusals."""

from __future__ import annotations

import json
import math

import jax
import pytest

from hisparse_jax.cli import main
from hisparse_jax.harness import kernel_bench as bk
from tests.helpers import cli_error

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

FIELDS = {"case", "implementation", "op", "backend", "interpret", "command", "compile_s",
          "median_s", "min_s", "max_s", "p25_s", "p75_s", "iters", "warmup", "times_s", "bytes",
          "bytes_per_s", "max_abs_err", "max_rel_err", "tolerance", "ok", "batch", "context",
          "kv_heads", "q_heads", "head_dim", "page", "cold_pages"}


def test_ci_case_json_rows(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    main(["bench", "kernels", "--case", "ci", "--iters", "3", "--warmup", "1",
          "--json", str(path)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    got = {(r["implementation"], r["op"]) for r in rows}
    assert got == {(i, o) for i in ("pallas", "xla") for o in ("lookup", "sparse_decode", "step")
                   } | {("xla", "dense")}
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["case"] == "ci" and r["backend"] == jax.default_backend()
        assert r["command"].startswith("hisparse bench kernels --case ci")
        assert "--json" in r["command"]
        assert len(r["times_s"]) == r["iters"] == 3
        for f in ("compile_s", "median_s", "min_s", "max_s", "p25_s", "p75_s", "bytes_per_s"):
            assert math.isfinite(r[f]) and r[f] > 0, f
        assert r["min_s"] <= r["p25_s"] <= r["median_s"] <= r["p75_s"] <= r["max_s"]
        assert r["bytes"] == bk.op_bytes(r, r["op"]) > 0
        assert r["bytes_per_s"] == pytest.approx(r["bytes"] / r["median_s"])
        if r["implementation"] == "pallas":
            assert r["interpret"] is (jax.default_backend() != "gpu")
            assert r["max_rel_err"] < 1e-4 and r["max_abs_err"] < 1e-4 and r["ok"] is True
        elif r["op"] == "dense":
            assert r["max_rel_err"] is None
        else:
            assert r["max_rel_err"] == 0.0
    step = [r for r in rows if r["op"] == "step" and r["implementation"] == "pallas"]
    assert step[0]["selection_mismatches"] == 0
    byop = {r["op"]: r["bytes"] for r in rows}
    assert byop["step"] < byop["dense"]  # the sparse step reads less than dense attention
    out = capsys.readouterr().out  # the table
    assert "sparse_decode" in out and "median ms" in out


def test_json_file_in_a_new_folder_and_bad_path(tmp_path, capsys):
    path = tmp_path / "results" / "sub" / "rows.jsonl"  # like benchmarks/results/ in a clone
    main(["bench", "kernels", "--case", "ci", "--impl", "xla", "--ops", "lookup",
          "--iters", "1", "--warmup", "0", "--json", str(path)])
    assert len(path.read_text().splitlines()) >= 1
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "cannot write" in cli_error(capsys, [  # refused before any timing
        "bench", "kernels", "--case", "ci", "--impl", "xla", "--ops", "lookup",
        "--json", str(blocker / "rows.jsonl")])


def test_json_to_stdout(capsys):
    main(["bench", "kernels", "--case", "ci", "--impl", "xla", "--ops", "lookup,dense",
          "--iters", "2", "--warmup", "0", "--json", "-"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["implementation"], r["op"]) for r in rows] == [("xla", "lookup"), ("xla", "dense")]


@pytest.mark.parametrize("argv,msg", [
    (["--case", "decode_2k_b1"], "--case: unknown 'decode_2k_b1'; choose from ci, decode_32k_b1"),
    (["--case", "ci", "--impl", "triton"], "--impl: unknown 'triton'"),
    (["--case", "ci", "--ops", "prefill"], "--ops: unknown 'prefill'"),
    (["--case", "ci", "--iters", "0"], "argument --iters: must be >= 1"),
])
def test_bad_request_is_a_clean_error(capsys, argv, msg):
    assert msg in cli_error(capsys, ["bench", "kernels", *argv])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled Pallas on a GPU")
def test_pallas_large_case_refused_off_gpu(capsys):
    assert "interpret mode, allowed only for the 'ci' case" in cli_error(
        capsys, ["bench", "kernels", "--case", "decode_128k_b8"])
    assert "interpret mode" in cli_error(capsys, ["bench", "kernels", "--case", "all",
                                                  "--impl", "pallas"])


def test_cases_and_byte_model():
    assert set(bk.CASES) == {"ci"} | {f"decode_{c}_b{b}" for c in ("32k", "128k", "1m")
                                      for b in (1, 8)}
    big = bk.CASES["decode_1m_b8"]
    assert (big.kv_heads, big.group, big.head_dim) == (8, 4, 128)
    assert (big.batch, big.context) == (8, 1 << 20)
    # Shapes only: no array is built for a 1M-token batch of 8.
    dims = {"batch": 8, "context": 1 << 20, "kv_heads": 8, "q_heads": 32, "head_dim": 128,
            "page": 16, "bf16_tokens": 144, "fp8_tokens": 384, "candidate_pages": 65536 - 33,
            "cold_pages": 128, "sample_pages": 32, "value_group": 32}
    assert bk.op_bytes(dims, "dense") == 8 * 32 * 128 * 4 + 8 * 8 * (1 << 20) * 128 * 4 + 32
    assert bk.op_bytes(dims, "step") == (bk.op_bytes(dims, "lookup") +
                                         bk.op_bytes(dims, "sparse_decode") - 8 * 32 * 128 * 4)
    assert bk.op_bytes(dims, "step") < bk.op_bytes(dims, "dense") / 5
    assert bk.case_nbytes(big, with_dense=True) > 32 * 2**30


def test_random_inputs_are_finite_at_the_counter_extremes():
    # Every uint32 maps strictly inside (0, 1), so "normal" inputs (erfinv) are
    # finite: the 24-bit version made +inf once in 2**24 entries.
    x = jax.numpy.array([0, 1, 511, 512, 0x7FFFFFFF, 0xFFFFFF7F, 0xFFFFFF80, 0xFFFFFFFF],
                        jax.numpy.uint32)
    u = bk.unit_interval(x)
    assert bool(((u > 0) & (u < 1)).all())
    normal = math.sqrt(2.0) * jax.scipy.special.erfinv(2.0 * u - 1.0)
    assert bool(jax.numpy.isfinite(normal).all())
    assert float(normal.max()) > 5 and float(normal.min()) < -5  # the tails are still there
