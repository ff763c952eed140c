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


def _benchmark_module(name):
    import importlib
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_weight_quant_products_and_the_block_hook():
    """`benchmarks/weight_quant.py`: each int8 product is within the bound its
    rounding allows (half a quantization step per element, summed through the
    weights: a grouped product that mixed up its groups is far past it), the
    grouped activation scale beats the per-row one on an outlier channel, and
    QuantBlock runs through `Block.product` in a real model."""
    import jax.numpy as jnp
    import numpy as np

    from hisparse_jax.models.llama import Llama
    from tests.models_fixtures import hf_weights, model_weights, tiny_config
    module = _benchmark_module("weight_quant")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    x[:, 7] *= 30  # an outlier channel: one scale per row loses the others' precision
    w = (rng.standard_normal((256, 96)) / 16).astype(np.float32)
    codes, scale = (np.asarray(a) for a in module.absmax_int8(w, 0))
    wq = codes * scale
    exact = x @ wq

    def bound(step):  # step [3, 256]: each input's rounding step
        return 0.5 * step @ np.abs(wq) + 1e-5 * np.abs(x) @ np.abs(wq)

    row_step = np.abs(x).max(1, keepdims=True) / 127 * np.ones_like(x)
    g64_step = np.repeat(np.abs(x.reshape(3, 4, 64)).max(2) / 127, 64, axis=1)
    bounds = {"w8a16": bound(np.abs(x) * 2.0 ** -8), "w8a8-row": bound(row_step),
              "w8a8-g64": bound(g64_step)}
    err = {}
    for k, f in module.VARIANTS.items():
        got = np.asarray(f(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale)))
        err[k] = np.abs(got - exact)
        assert (err[k] <= bounds[k]).all(), (k, float((err[k] / bounds[k]).max()))
    # the outlier's group keeps the row's coarse step, the other 3 of 4 groups a
    # ~30x finer one: about sqrt(64/256) = 0.5 of the row scale's error
    assert err["w8a8-g64"].mean() < 0.7 * err["w8a8-row"].mean()

    cfg = tiny_config()
    weights = model_weights(cfg, hf_weights(cfg))
    ids = jnp.asarray([5, 9, 200, 31, 7, 64, 1, 99], jnp.int32)
    logits = {}
    for kind in ("bf16", *module.VARIANTS):
        model = (Llama(cfg, weights) if kind == "bf16"
                 else module.quantized(Llama(cfg, weights), kind))
        h, _ = model.layers(model.embed_tokens(ids), jnp.arange(8), None,
                            lambda c, layer, q, k, v: (q, c))
        logits[kind] = np.asarray(model.logits(h))
    assert module.quantized(Llama(cfg, weights), "w8a16").blocks.wq[...].dtype == jnp.int8
    for kind in module.VARIANTS:  # 0 would mean the hook was not used
        rel = np.abs(logits[kind] - logits["bf16"]).max() / np.abs(logits["bf16"]).max()
        assert 0 < rel < 0.1, (kind, rel)
