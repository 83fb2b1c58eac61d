"""Per-request latency metrics of an ingress replica (Prometheus, names as vLLM's, `orca:`).

Measured where the client sees them: from the request's arrival at the replica to each
piece of text it streams. Each replica hands a snapshot of its series to the scheduler
every few seconds; GET /metrics, on whichever replica answers it, sums its own live series
with the other replicas' latest snapshots (counters and histograms add up across
processes), then appends the engine's own metrics.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

FINISH_REASONS = ("stop", "length", "abort", "deadline")
FAILURE_REASONS = ("timeout", "client_disconnect", "engine_failure", "engine_unavailable",
                   "queue_full", "too_long", "draining")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class HTTPMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def hist(name, doc):
            return Histogram(name, doc, labelnames=labels, buckets=LATENCY_BUCKETS,
                             registry=r).labels(**labels)

        self.ttft = hist("orca:time_to_first_token_seconds", "Arrival to the first token")
        self.tpot = hist("orca:time_per_output_token_seconds",
                         "Mean time per output token after the first, per request")
        self.itl = hist("orca:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = hist("orca:e2e_request_latency_seconds", "Arrival to the last token")
        self._success = Counter("orca:request_success", "Finished requests, by finish reason",
                                labelnames=[*labels, "finished_reason"], registry=r)
        self._failure = Counter("orca:request_failure", "Requests that failed or were "
                                "aborted, by reason", labelnames=[*labels, "reason"], registry=r)
        # every series from the start (at 0), so dashboards and rate() see them, as vLLM's
        for reason in FINISH_REASONS:
            self._success.labels(**labels, finished_reason=reason)
        for reason in FAILURE_REASONS:
            self._failure.labels(**labels, reason=reason)

    def success(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def failure(self, reason: str) -> None:
        self._failure.labels(**self._labels, reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> Snapshot:
        """This replica's series as plain data: (name, type, help, [(sample, labels, value)])."""
        return [(m.name, m.type, m.documentation, [(s.name, s.labels, s.value) for s in m.samples])
                for m in self.registry.collect()]


# one replica's series: [(family name, type, help, [(sample name, labels, value)])]
Snapshot = list[tuple[str, str, str, list[tuple[str, dict, float]]]]


class _Summed:
    """A collector of several replicas' snapshots, each series summed over the replicas (a
    `_created` timestamp takes the earliest)."""

    def __init__(self, snapshots: list[Snapshot]):
        self.snapshots = snapshots

    def collect(self):
        families: dict[str, tuple[str, str, dict]] = {}
        for snapshot in self.snapshots:
            for name, kind, doc, samples in snapshot:
                values = families.setdefault(name, (kind, doc, {}))[2]
                for sample, labels, value in samples:
                    key = (sample, tuple(labels.items()))
                    old = values.get(key)
                    values[key] = value if old is None else \
                        min(old, value) if sample.endswith("_created") else old + value
        for name, (kind, doc, values) in families.items():
            family = Metric(name, doc, kind)
            for (sample, labels), value in values.items():
                family.add_sample(sample, dict(labels), value)
            yield family


def render_summed(snapshots: list[Snapshot]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Summed(snapshots))
    return generate_latest(registry)


class RequestTimer:
    """Token arrival times of one choice, folded into HTTPMetrics as they come."""

    def __init__(self, metrics: HTTPMetrics, start: float | None = None):
        self.metrics = metrics
        self.start = time.monotonic() if start is None else start  # the request's arrival
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0

    def tokens(self, count: int, now: float | None = None) -> None:
        """`count` tokens arrived `now` (default: at this moment)."""
        if count == 0:
            return
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
            count -= 1  # the first token has a TTFT, not an inter-token gap
            self.num_tokens += 1
        elif count:
            gap = (now - self.last) / count  # tokens that arrived together share the gap
            for _ in range(count):
                self.metrics.itl.observe(gap)
        self.num_tokens += count
        self.last = now

    def done(self, finish_reason: str) -> None:
        """The request ended well: its end-to-end latency (also when it returned no token, as
        an echo of the prompt alone), and its time per output token."""
        self.metrics.e2e.observe((self.last or time.monotonic()) - self.start)
        if self.num_tokens > 1:
            self.metrics.tpot.observe((self.last - self.first) / (self.num_tokens - 1))
        self.metrics.success(finish_reason)
