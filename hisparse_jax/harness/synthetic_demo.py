"""`hisparse demo`: a realistic synthetic long context, HiSparse vs dense, side by side."""

from __future__ import annotations

import time

import numpy as np

from hisparse_jax.cache.layout import capacity_report
from hisparse_jax.config import preset
from hisparse_jax.harness.attention_bench import bench_attention
from hisparse_jax.harness.evaluation import evaluate, needle_pages_hit
from hisparse_jax.harness.workloads import HEAD_KINDS, make_workload


def run_demo(context: int = 131072, log=print):
    cfg = preset("default")
    t0 = time.time()
    log(f"[1/4] generating a {context}-token context: 4 KV heads x 4 query heads, "
        f"head_dim {cfg.head_dim} (sink, local, retrieval, diffuse heads) ...")
    w = make_workload(context=context, num_kv_heads=4, gqa_group=4, head_dim=cfg.head_dim,
                      num_queries=8, seed=0)
    log(f"[2/4] filling the HiSparse cache and attending 8 decode queries "
        f"(budget {cfg.budget_tokens} cold tokens per KV head, re-ranked from "
        f"{cfg.candidate_pages} candidate pages, and {cfg.tail_sample_pages + cfg.rerank_samples} "
        f"sampled pages to estimate the rest) ...")
    ev = evaluate(cfg, w.q, w.k, w.v)
    kinds = np.array(w.head_kinds)
    log("[3/4] timing decode attention, HiSparse vs dense bf16, Llama-3-8B KV shapes ...")
    speed = bench_attention(context, log=log)
    cap = capacity_report(cfg.replace(max_context=1 << 20), 1 << 20)
    log("[4/4] done in %.0f s" % (time.time() - t0))

    print(f"\nHiSparse vs dense attention, {context} tokens, preset 'default'\n")
    print(f"{'heads':<10}{'recall':>8}{'p5':>7}{'oracle':>8}{'rel.err':>9}{'select.':>9}"
          f"{'no est.':>9}{'quant.':>8}{'top-10':>8}")
    for kd in (*HEAD_KINDS, "all"):
        s = ev.summary(None if kd == "all" else np.flatnonzero(kinds == kd))
        print(f"{kd:<10}{s['recall_mean']:>8.3f}{s['recall_p5']:>7.3f}"
              f"{s['oracle_recall_mean']:>8.3f}{s['rel_error_mean']:>9.3f}"
              f"{s['selection_error_mean']:>9.3f}{s['unsampled_selection_error_mean']:>9.3f}"
              f"{s['quant_error_mean']:>8.3f}"
              f"{s['top10_recall']:>8.3f}")
    hit, total = needle_pages_hit(ev, w.needle_targets, min_mass=0.01)
    print(f"\nneedle pages attended (>= 1% of a head's mass): {hit}/{total}")
    print(f"attended tokens: {ev.attended_fraction:.2%} of the context, plus "
          f"{cfg.tail_sample_pages + cfg.rerank_samples} sampled pages per KV head "
          f"({cfg.candidate_pages} candidates' keys scored)")
    print("select. = selection error with the tail estimate; no est. = without it")
    print(f"decode attention: dense {speed['dense_ms']:.1f} ms, HiSparse "
          f"{speed['hisparse_ms']:.1f} ms -> {speed['speedup']:.1f}x faster (same run, CPU/XLA)")
    print(f"capacity at 1M tokens: {cap['device_bytes_per_token']:.0f} B/token/head vs "
          f"{cap['bf16_bytes_per_token']:.0f} for bf16 -> {cap['capacity_vs_bf16']:.2f}x")
