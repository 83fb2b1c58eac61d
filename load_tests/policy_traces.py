"""Workloads for the scheduling-policy comparison: TCB's and ORCA's, with Poisson arrivals and
start-by deadlines, and the rates that bracket an engine's saturation point.

Deadlines: every request must *start* (be scheduled for the first time) within
    deadline_s = slack * (prompt_len + max_tokens) * per_token_s,  slack ~ U(1.5, 4),
of its arrival, the rule of traces.tcb_trace (TCB publishes no distribution); the engine
finishes a request that has not started by then with finish_reason "deadline" (TCB: a
request not scheduled before its deadline fails and scores no utility). per_token_s is the
engine's unloaded time per token under the cost model (`unloaded_per_token_s`), so slack
reads as "times the unloaded latency".
"""
from __future__ import annotations

import random
import statistics

from load_tests.cost_model import CostModel, StepFeatures
from load_tests.traces import TraceRequest, arrival_times, orca_trace, tcb_trace

SLACK = (1.5, 4.0)
WORKLOADS = ("tcb", "orca")


def orca_poisson_trace(num_requests: int, rate: float, per_token_s: float, seed: int = 0,
                       vocab_size: int = 256) -> list[TraceRequest]:
    """ORCA's lengths (prompt ~ U(32, 512), max_tokens ~ U(1, 128)) arriving as a Poisson
    process at `rate`, with deadlines by the rule above. Lengths and slacks do not depend on
    the rate: each rate replays the same requests, only closer together."""
    trace = orca_trace(num_requests, vocab_size, seed)
    rng = random.Random(seed + 2)
    for r, t in zip(trace, arrival_times(num_requests, rate, seed=seed + 1)):
        r.arrival_s = t
        r.deadline_s = rng.uniform(*SLACK) * (len(r.prompt_token_ids) + r.max_tokens) * per_token_s
    return trace


def workload(name: str, num_requests: int, rate: float, per_token_s: float, seed: int = 0,
             variance: float = 20.0, vocab_size: int = 256) -> list[TraceRequest]:
    """`tcb`: TCB section 6.2 (lengths 3-100 ~ N(20, variance), see traces.tcb_trace);
    `orca`: ORCA section 6.2 lengths; both Poisson at `rate` req/s with deadlines."""
    if name == "tcb":
        return tcb_trace(num_requests, rate, variance, vocab_size, seed, slack=SLACK,
                         per_token_s=per_token_s)
    if name == "orca":
        return orca_poisson_trace(num_requests, rate, per_token_s, seed, vocab_size)
    raise ValueError(f"unknown workload {name!r}; known: {WORKLOADS}")


def unloaded_per_token_s(cost: CostModel, context_len: int = 40) -> float:
    """One decode iteration of a lone request: its normalized latency on an idle engine."""
    return cost.step_time(StepFeatures(decode_requests=1, context_tokens=context_len))


def capacity_estimate(cost: CostModel, max_batch_size: int, trace: list[TraceRequest]) -> float:
    """Requests/s the engine completes with every row busy (an estimate, to place the rate
    sweep; the sweep itself shows where throughput stops growing).

    In steady state each of the B resident requests holds its row for max_tokens iterations
    (the prefill iteration samples the first token), so B / mean(max_tokens) prompts enter
    per iteration and the rest of the rows decode."""
    b = max_batch_size
    prompt = statistics.fmean(len(r.prompt_token_ids) for r in trace)
    prompt_sq = statistics.fmean(len(r.prompt_token_ids) ** 2 for r in trace)
    out = statistics.fmean(r.max_tokens for r in trace)
    new = min(b / out, b)
    step = StepFeatures(prefill_tokens=new * prompt, prefill_requests=new,
                        decode_requests=b - new, context_tokens=(b - new) * (prompt + out / 2),
                        prefill_attention_pairs=new * prompt_sq)
    return b / (out * cost.step_time(step))
