"""Serving metrics of one load run: vLLM's benchmark set (throughputs; TTFT, TPOT, ITL and
end-to-end latency as mean/median/p90/p99; goodput under SLOs), ORCA's normalized latency
and, for traces that carry them, the share of TCB-style deadlines met.

Definitions (times measured by the client, from sending the request):
  TTFT        until the first streamed chunk with text.
  ITL         gaps between successive chunks with text (a chunk may carry several tokens,
              e.g. when bytes of one character arrive in separate tokens), pooled over requests.
  TPOT        per request, (latency - TTFT) / (output tokens - 1); requests of one token have none.
  normalized  per request, end-to-end latency / output tokens (ORCA's Figure 10 metric).
  goodput     completed requests meeting every SLO that is set, per second of the run.
Percentiles are numpy's default ("linear": interpolated between the two closest ranks), as
vLLM reports them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestOutcome:
    prompt_len: int
    max_tokens: int
    deadline_s: float | None = None
    is_success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    end_s: float = 0.0  # completion time on the run's clock (perf_counter)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, as the server's usage reported
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def sent_s(self) -> float:
        """When it was sent, on the run's clock (that of end_s)."""
        return self.end_s - self.latency_s


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request service level objectives in milliseconds; None: not part of goodput."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def is_met(self, o: RequestOutcome) -> bool:
        if not o.is_success:
            return False
        checks = [(self.ttft_ms, o.ttft_s), (self.tpot_ms, o.tpot_s or 0.0),
                  (self.e2e_ms, o.latency_s)]
        return all(limit is None or value * 1e3 <= limit for limit, value in checks)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), interpolating between the two closest ranks."""
    if not values:  # numpy would raise IndexError
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return float(np.percentile(values, q, method="linear"))


def distribution(values_s: Sequence[float]) -> dict | None:
    """mean/median/p90/p99 in milliseconds of values in seconds; None when there are none."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    median, p90, p99 = np.percentile(ms, [50, 90, 99], method="linear")
    return {"mean": float(ms.mean()), "median": float(median), "p90": float(p90),
            "p99": float(p99)}


def ratio_interval(before: Sequence[float], after: Sequence[float], q: float,
                   blocks: tuple[Sequence[int], Sequence[int]] | None = None,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The ratio of the q-th percentiles of two samples, after / before, and its 95%
    bootstrap interval: how well one run decides a target such as "TTFT p99 at most 1.1x".
    `blocks`: each value's block in either sample (the second its request was sent in);
    whole blocks are resampled, since requests sent close together share their slowdowns
    (resampling single requests would give too narrow an interval). None: each value alone."""
    rng = np.random.default_rng(seed)
    groups = []
    for values, block in zip((before, after), blocks or (None, None)):
        values = np.asarray(values, dtype=np.float64)
        groups.append(values[:, None] if block is None else
                      [values[np.asarray(block) == b] for b in np.unique(block)])

    def resample(parts: list) -> np.ndarray:
        return np.concatenate([parts[i] for i in rng.integers(len(parts), size=len(parts))])

    ratios = [np.percentile(resample(groups[1]), q) / np.percentile(resample(groups[0]), q)
              for _ in range(resamples)]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return (float(np.percentile(np.concatenate(groups[1]), q)
                  / np.percentile(np.concatenate(groups[0]), q)), float(low), float(high))


def worst_ttft_per_second(outcomes: Sequence[RequestOutcome],
                          start_s: float) -> list[float | None]:
    """The longest TTFT (ms) of the requests sent in each second of a run, from `start_s` on
    the run's clock: a stall of the server shows as a few seconds that stand out. None for a
    second in which no request that succeeded was sent (failures have no TTFT)."""
    sent = [(int(max(o.sent_s - start_s, 0.0)), round(o.ttft_s * 1e3, 1))
            for o in outcomes if o.is_success]
    worst: list[float | None] = [None] * (max((t for t, _ in sent), default=-1) + 1)
    for t, ttft in sent:
        worst[t] = max(worst[t] or 0.0, ttft)
    return worst


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float, slo: SLO = SLO()) -> dict:
    """The run's metrics as a JSON-ready dict (latencies in ms, throughputs per second)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [o for o in outcomes if o.is_success]
    num_out = sum(o.num_output_tokens for o in ok)
    num_prompt = sum(o.prompt_len for o in ok)
    result = {
        "num_requests": len(outcomes), "completed": len(ok), "failed": len(outcomes) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_out / duration_s,
        "total_token_throughput": (num_prompt + num_out) / duration_s,
        "total_prompt_tokens": num_prompt, "total_output_tokens": num_out,
        # prompt tokens the server's prefix cache supplied (its usage.prompt_tokens_details)
        "cached_prompt_fraction": sum(o.num_cached_tokens for o in ok) / max(1, num_prompt),
        # with ignore_eos every request must produce max_tokens; fewer means a server bug
        "num_short_outputs": sum(1 for o in ok if o.num_output_tokens < o.max_tokens),
        "ttft_ms": distribution([o.ttft_s for o in ok]),
        "tpot_ms": distribution([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_ms": distribution([gap for o in ok for gap in o.itl_s]),
        "e2e_latency_ms": distribution([o.latency_s for o in ok]),
        "normalized_latency_ms": distribution([o.latency_s / o.num_output_tokens
                                               for o in ok if o.num_output_tokens > 0]),
    }
    if slo.is_set:
        num_good = sum(1 for o in outcomes if slo.is_met(o))
        result["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
        result["goodput"] = num_good / duration_s
        result["slo_attainment"] = num_good / len(outcomes) if outcomes else 0.0
    with_deadline = [o for o in outcomes if o.deadline_s is not None]
    if with_deadline:
        result["deadline_met"] = sum(1 for o in with_deadline if o.is_success
                                     and o.latency_s <= o.deadline_s) / len(with_deadline)
    errors = Counter(o.error for o in outcomes if not o.is_success)
    result["errors"] = [{"error": e[:300], "count": n} for e, n in errors.most_common(5)]
    return result
