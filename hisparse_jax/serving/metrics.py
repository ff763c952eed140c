"""Prometheus metrics, named as vLLM's with a `hisparse:` prefix (one registry per
server, so two servers in a process never share counters)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # as vLLM: no *_created series

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class Metrics:
    def __init__(self, model_name: str, price_per_hour: float | None = None):
        self.registry = r = CollectorRegistry()
        self.price_per_hour = price_per_hour
        self.running = Gauge("hisparse:num_requests_running", "Requests in a slot (prefill "
                             "or decode)", registry=r)
        self.waiting = Gauge("hisparse:num_requests_waiting", "Requests in the wait queue",
                             registry=r)
        self.kv_usage = Gauge("hisparse:kv_cache_usage_perc", "Share of the slots' token "
                              "capacity in use (1 = full)", registry=r)
        self.prompt_tokens = Counter("hisparse:prompt_tokens", "Prefilled prompt tokens",
                                     registry=r)
        self.generation_tokens = Counter("hisparse:generation_tokens", "Generated tokens",
                                         registry=r)
        self.success = Counter("hisparse:request_success", "Finished requests by reason",
                               ["finished_reason"], registry=r)
        self.rejected = Counter("hisparse:request_rejected", "Requests refused before "
                                "running, by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("hisparse:time_to_first_token_seconds", "Arrival to first "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("hisparse:inter_token_latency_seconds", "Between two tokens of "
                             "a request", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("hisparse:e2e_request_latency_seconds", "Arrival to the last "
                             "token", buckets=E2E_BUCKETS, registry=r)
        self.throughput = Gauge("hisparse:generation_throughput_busy_tokens_per_second",
                                "Generated tokens per second of engine time that had work",
                                registry=r)
        self.cost = Gauge("hisparse:cost_per_1k_generation_tokens_dollars",
                          "--price-per-hour / (3600 x the busy throughput) x 1000; NaN "
                          "without a price or before the first token", registry=r)
        info = Gauge("hisparse:model_info", "The served model (always 1)", ["model"],
                     registry=r)
        info.labels(model=model_name).set(1)

    def update_cost(self, generated: int, busy_s: float):
        """The cost figure from what was measured: tokens generated per second of
        engine time spent on work (idle time is not billed to the tokens)."""
        tps = generated / busy_s if busy_s > 0 else 0.0
        self.throughput.set(tps)
        if self.price_per_hour is None or tps <= 0:
            self.cost.set(math.nan)
        else:
            self.cost.set(self.price_per_hour / 3600 / tps * 1000)
