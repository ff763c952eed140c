"""Smoke runs of the benchmark script that reaches into library internals
(`benchmarks/selection_gap.py` patches the lookup reference and calls a private
selection function): a refactor that breaks it fails here. Each run is
a subprocess, so a patched module never leaks into other tests."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "benchmarks", "selection_gap.py")
    proc = subprocess.run([sys.executable, script, *args], check=False, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_selection_gap_quality_rows():
    rows = _run("--context", "4096", "--seed", "3", "--queries", "2", "--rerank", "1.5",
                "--mixed-groups")
    assert [r["variant"] for r in rows] == ["shipped", "digest", "page_mean",
                                            "window_weights", "rerank_x1.5"]
    for r in rows:
        assert 0.5 < r["concentrated_recall"] <= 1.0 + 1e-6
        assert 0.5 < r["all_vs_oracle"] <= 1.0 + 1e-6  # nothing beats the oracle overall
        assert {"sink_vs_oracle", "local_vs_oracle", "retrieval_vs_oracle",
                "diffuse_vs_oracle"} <= set(r)


def test_selection_gap_timing_row():
    (row,) = _run("--time-rerank", "8192")
    assert row["context"] == 8192
    timed = [key for key in row if key.endswith("_ms")]
    assert len(timed) == 4 and all(row[key] > 0 for key in timed)
    assert all(row[f"speedup_rerank_x{m}"] > 0 for m in (1, 1.25, 1.5))
