"""Prometheus metrics, named as vLLM's with a `hisparse:` prefix and, as vLLM's, a
`model_name` label (one process may serve several models). One registry per
server, so two servers in a process never share counters. `Metrics.bind(name)`
gives one model's series (what its scheduler updates)."""

from __future__ import annotations

import math
import types

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

disable_created_metrics()  # as vLLM: no *_created series

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
M = ["model_name"]


class Metrics:
    def __init__(self, price_per_hour: float | None = None):
        self.registry = r = CollectorRegistry()
        self.price_per_hour = price_per_hour
        self.families = {
            "running": Gauge("hisparse:num_requests_running", "Requests in a slot (prefill "
                             "or decode)", M, registry=r),
            "waiting": Gauge("hisparse:num_requests_waiting", "Requests in the wait queue",
                             M, registry=r),
            "kv_usage": Gauge("hisparse:kv_cache_usage_perc", "Share of the slots' token "
                              "capacity in use (1 = full)", M, registry=r),
            "pool_usage": Gauge("hisparse:kv_cold_pool_usage_perc", "Share of the HiSparse "
                                "cold page pool in use, read from the live pool (0 for "
                                "dense)", M, registry=r),
            "pool_pages": Gauge("hisparse:kv_cold_pool_pages", "Cold pool pages summed over "
                                "the layers: used (read from the live pool; pages only "
                                "unused prefix entries hold count as free), reserved (what "
                                "the running requests may still take, up to prompt + "
                                "max_tokens each), pinned (prewarmed documents), cached "
                                "(unused prefix entries, evicted on demand) and total",
                                [*M, "state"], registry=r),
            "prefix_pages": Counter("hisparse:prefix_index_pages", "Prompt pages looked up "
                                    "in the prefix index of cold pages (per layer): hit "
                                    "(an equal, verified page: shared where cold), miss, "
                                    "collision (a hash held by other tokens: never shared) "
                                    "and eviction", [*M, "result"], registry=r),
            "prompt_tokens": Counter("hisparse:prompt_tokens", "Prefilled prompt tokens", M,
                                     registry=r),
            "generation_tokens": Counter("hisparse:generation_tokens", "Generated tokens", M,
                                         registry=r),
            "prefill_batched": Counter("hisparse:prefill_batched_prompts", "Short prompts "
                                       "prefilled together with others, in one program",
                                       M, registry=r),
            "prefill_deferred": Counter("hisparse:prefill_blocks_deferred", "Prompt blocks "
                                        "put off because running them beside the decodes "
                                        "would break --tpot-slo-ms", M, registry=r),
            "gang_streams": Counter("hisparse:gang_streams", "Streams that started "
                                    "decoding together, their first tokens in one step "
                                    "(--tpot-slo-ms gangs)", M, registry=r),
            "prefix_queries": Counter("hisparse:prefix_cache_queries", "Prompt tokens looked "
                                      "up among the prewarmed contexts", M, registry=r),
            "prefix_hits": Counter("hisparse:prefix_cache_hits", "Prompt tokens whose "
                                   "prefill a prewarmed context skipped", M, registry=r),
            "cold_pages_read": Counter("hisparse:cold_pages_read", "Cold int4 pages attended "
                                       "by decode steps (per layer and KV head; computed "
                                       "from the selection budget and each sequence's cold "
                                       "pages)", M, registry=r),
            "offload_pages": Counter("hisparse:offload_cold_pages", "Offload mode: cold "
                                     "pages a decode step selected (per layer and KV head) "
                                     "found resident (hit) or copied from host memory "
                                     "(miss), and pages prefetched from the layer below's "
                                     "candidates (prefetch)", [*M, "result"], registry=r),
            "offload_bytes": Counter("hisparse:offload_host_to_device_bytes", "Offload mode: "
                                     "bytes of cold pages copied from host memory (working "
                                     "sets and sample buffers)", M, registry=r),
            "offload_hit_rate": Gauge("hisparse:offload_resident_hit_rate", "Offload mode: "
                                      "share of the selected cold pages found resident, "
                                      "since the start", M, registry=r),
            "tier_tokens": Gauge("hisparse:kv_tier_tokens", "Tokens held per tier over the "
                                 "running sequences (HiSparse)", [*M, "tier"], registry=r),
            "poisoned": Gauge("hisparse:poisoned_sequences", "Sequences whose K/V took a "
                              "non-finite value (their outputs are NaN until released)", M,
                              registry=r),
            "success": Counter("hisparse:request_success", "Finished requests by reason",
                               [*M, "finished_reason"], registry=r),
            "ttft": Histogram("hisparse:time_to_first_token_seconds", "Arrival to first "
                              "token", M, buckets=TTFT_BUCKETS, registry=r),
            "itl": Histogram("hisparse:inter_token_latency_seconds", "Between two tokens of "
                             "a request", M, buckets=ITL_BUCKETS, registry=r),
            "e2e": Histogram("hisparse:e2e_request_latency_seconds", "Arrival to the last "
                             "token", M, buckets=E2E_BUCKETS, registry=r),
            "throughput": Gauge("hisparse:generation_throughput_busy_tokens_per_second",
                                "Generated tokens per second of engine time that had work",
                                M, registry=r),
            "cost": Gauge("hisparse:cost_per_1k_generation_tokens_dollars",
                          "--price-per-hour / (3600 x the busy throughput) x 1000; NaN "
                          "without a price or before the first token", M, registry=r),
        }
        self.rejected = Counter("hisparse:request_rejected", "Requests refused before "
                                "running, by HTTP status", ["status"], registry=r)

    def bind(self, model_name: str, offload: bool = False) -> types.SimpleNamespace:
        """One model's series: attributes named as `families`' keys; `success` keeps
        its finished_reason label (`.labels(finished_reason=...)`). The offload
        series only for a model served with offload."""
        skip = {"success", "tier_tokens", "pool_pages", "prefix_pages", "offload_pages"}
        if not offload:
            skip |= {"offload_bytes", "offload_hit_rate"}
        out = {k: f.labels(model_name=model_name) for k, f in self.families.items()
               if k not in skip}
        success, tiers = self.families["success"], self.families["tier_tokens"]
        pool, prefix = self.families["pool_pages"], self.families["prefix_pages"]
        out["pool_pages"] = types.SimpleNamespace(
            labels=lambda state: pool.labels(model_name=model_name, state=state))
        out["prefix_pages"] = types.SimpleNamespace(
            labels=lambda result: prefix.labels(model_name=model_name, result=result))
        offload = self.families["offload_pages"]
        out["offload_pages"] = types.SimpleNamespace(
            labels=lambda result: offload.labels(model_name=model_name, result=result))
        out["success"] = types.SimpleNamespace(
            labels=lambda finished_reason: success.labels(model_name=model_name,
                                                          finished_reason=finished_reason))
        out["tier_tokens"] = types.SimpleNamespace(
            labels=lambda tier: tiers.labels(model_name=model_name, tier=tier))
        return types.SimpleNamespace(**out)

    def update_cost(self, model: types.SimpleNamespace, generated: int, busy_s: float):
        """The cost figure from what was measured: tokens generated per second of
        engine time spent on work (idle time is not billed to the tokens)."""
        tps = generated / busy_s if busy_s > 0 else 0.0
        model.throughput.set(tps)
        if self.price_per_hour is None or tps <= 0:
            model.cost.set(math.nan)
        else:
            model.cost.set(self.price_per_hour / 3600 / tps * 1000)
