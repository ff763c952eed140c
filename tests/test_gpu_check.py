"""benchmarks/gpu_check.py, the one script for the H200, in its CPU dry run: every
check runs (Pallas in interpret mode, tiny shapes) and passes, so that a device
session does not spend its minutes on a broken script."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dry_run_checks_pass(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "rows.jsonl"
    assert gpu_check.main(["--dry-run", "--skip-kernels", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kernel"] for r in rows] == [
        "lookup.page_scores_vs_f64", "lookup.page_scores", "sparse_decode[bf16x3]", "sparse_decode[f32]",
        "sparse_decode[bf16]", "quant.encode_fp8", "quant.encode_cold_keys",
        "quant.encode_cold_values", "offload"]
    f64, checks = rows[0], rows[1:]  # the diagnostic: both sides against float64 scores
    assert f64["kind"] == "diagnostic"
    assert max(v for k, v in f64.items() if k.endswith("_rel_err")) < 1e-6, f64  # f32 sums
    assert all(r["kind"] == "check" and r["ok"] and r["dry_run"] and r["interpret"]
               for r in checks), checks
    for r in rows:
        if r["kernel"].startswith("sparse_decode"):
            assert r["nonfinite_out"] == r["nonfinite_ref"] == 0
