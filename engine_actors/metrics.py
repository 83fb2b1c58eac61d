"""The engine's Prometheus metrics, kept by the scheduler actor (names as vLLM's, `orca:`).

The ingress serves them on GET /metrics next to its own per-request latency metrics
(deployments/http_metrics.py). Each process has its own registry, rendered as text.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.running = Gauge("orca:num_requests_running", "Requests holding KV (started)",
                             labelnames=labels, registry=r).labels(**labels)
        self.waiting = Gauge("orca:num_requests_waiting", "Requests waiting to start",
                             labelnames=labels, registry=r).labels(**labels)
        self.kv_usage = Gauge("orca:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              labelnames=labels, registry=r).labels(**labels)
        self.batch_requests = Histogram(
            "orca:iteration_batch_requests", "Requests per iteration", labelnames=labels,
            buckets=BATCH_BUCKETS, registry=r).labels(**labels)
        self.batch_tokens = Histogram(
            "orca:iteration_batch_tokens", "Tokens per iteration", labelnames=labels,
            buckets=TOKEN_BUCKETS, registry=r).labels(**labels)
        self.queue_time = Histogram(
            "orca:request_queue_time_seconds", "Arrival to first scheduled iteration",
            labelnames=labels, buckets=QUEUE_BUCKETS, registry=r).labels(**labels)
        self.preemptions = Counter("orca:num_preemptions", "Requests preempted (recomputed)",
                                   labelnames=labels, registry=r).labels(**labels)
        self._finished = Counter("orca:request_finished", "Requests the engine finished, by "
                                 "finish reason", labelnames=[*labels, "finished_reason"],
                                 registry=r)
        self._labels = labels

    def finished(self, reason: str) -> None:
        self._finished.labels(**self._labels, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
