"""The scheduling simulator against hand-computed timelines, its metrics against hand-built
outcomes, and the cost-model fit against data with known coefficients. CPU, no Ray."""
from __future__ import annotations

import random

import pytest

from engine_actors.messages import StepInput
from load_tests.calibration import synthetic_step
from load_tests.cost_model import CostModel, StepFeatures, fit, select, step_features
from load_tests.policy_report import sweep_report
from load_tests.policy_traces import workload
from load_tests.simulator import EngineSpec, SimOutcome, SimResult, simulate
from load_tests.traces import TraceRequest

# one step costs 1 s, plus 0.1 s per prompt token and 0.5 s per decoding request
HAND = CostModel(c0=1.0, c_prefill=0.1, c_decode=0.5)


def req(prompt_len, max_tokens, arrival=0.0, deadline=None):
    return TraceRequest([3] * prompt_len, max_tokens, arrival, deadline)


def spec(batch, tokens=64, kv_tokens=1024):
    return EngineSpec(max_batch_size=batch, max_num_batched_tokens=tokens,
                      max_num_tokens=kv_tokens, block_size=4)


def finish_times(result):
    return [o.finish_s for o in result.outcomes]


def test_one_request_prefill_then_decodes():
    # prefill of 4 tokens: 1 + 0.4 -> first token at 1.4; two decodes of 1.5 s each
    result = simulate([req(4, 3)], "fcfs", spec(4), HAND)
    o = result.outcomes[0]
    assert (o.start_s, o.first_token_s) == (0.0, pytest.approx(1.4))
    assert o.finish_s == pytest.approx(4.4) and o.num_generated == 3
    assert o.finish_reason == "length" and result.num_steps == 3
    assert sweep_report(result)["request_throughput"] == pytest.approx(1 / 4.4)


def test_batch_of_one_serves_in_arrival_order_and_idles_until_the_next_arrival():
    trace = [req(2, 2, arrival=0.0), req(3, 1, arrival=0.5), req(1, 1, arrival=10.0)]
    result = simulate(trace, "fcfs", spec(1), HAND)
    # r0: prefill 1.2 -> 1.2, decode 1.5 -> 2.7; r1 (waiting since 0.5): prefill 1.3 -> 4.0;
    # idle until 10; r2: prefill 1.1 -> 11.1
    assert finish_times(result) == pytest.approx([2.7, 4.0, 11.1])
    assert [o.start_s for o in result.outcomes] == pytest.approx([0.0, 2.7, 10.0])


def test_mixed_iteration_costs_prefill_tokens_plus_decodes():
    trace = [req(2, 3, arrival=0.0), req(3, 1, arrival=0.5)]
    result = simulate(trace, "fcfs", spec(2), HAND)
    # 0 -> 1.2: r0 prefill; 1.2 -> 3.0: r0 decode + r1 prefill of 3 (1 + 0.5 + 0.3);
    # 3.0 -> 4.5: r0 decode
    assert finish_times(result) == pytest.approx([4.5, 3.0])
    assert result.num_steps == 3


def test_a_request_that_cannot_start_by_its_deadline_expires_and_scores_nothing():
    trace = [req(2, 2, arrival=0.0), req(3, 1, arrival=0.5, deadline=1.0)]  # start by 1.5
    result = simulate(trace, "fcfs", spec(1), HAND)
    late = result.outcomes[1]
    assert late.finish_reason == "deadline" and late.start_s is None
    assert late.finish_s == pytest.approx(2.7)  # dropped when r0 leaves the only row
    report = sweep_report(result)
    assert report["utility"] == pytest.approx(1 / 4) and report["hit_ratio"] == 0.5
    assert report["expired"] == 1 and report["completed"] == 1


def test_the_policy_decides_who_runs_first():
    # both waiting at t=0 with one row: FCFS starts the first arrival, SJF the short prompt
    trace = [req(10, 1, arrival=0.0), req(2, 1, arrival=0.0)]
    fcfs = simulate(trace, "fcfs", spec(1), HAND)
    sjf = simulate(trace, "sjf", spec(1), HAND)
    assert finish_times(fcfs) == pytest.approx([2.0, 3.2])
    assert finish_times(sjf) == pytest.approx([3.2, 1.2])


def test_metrics_of_hand_built_outcomes():
    outcomes = [
        SimOutcome(6, 4, arrival_s=1.0, deadline_s=5.0, start_s=2.0, finish_s=6.0,
                   finish_reason="length", num_generated=4),   # 1/10, 1.25 s/token
        SimOutcome(2, 2, arrival_s=2.0, deadline_s=3.0, start_s=3.0, finish_s=4.0,
                   finish_reason="length", num_generated=2),   # 1/4, 1.0 s/token
        SimOutcome(10, 10, arrival_s=3.0, deadline_s=4.0, finish_s=4.0,
                   finish_reason="deadline"),                  # never started
        SimOutcome(5, 5, arrival_s=3.0, deadline_s=4.0, start_s=3.5, finish_s=7.0,
                   finish_reason="deadline", num_generated=3),  # killed after starting
    ]
    r = sweep_report(SimResult(outcomes, num_steps=9, num_preemptions=2, busy_s=5.0, end_s=7.0))
    assert r["utility"] == pytest.approx(0.1 + 0.25)
    assert r["max_utility"] == pytest.approx(0.1 + 0.25 + 0.05 + 0.1)
    assert r["hit_ratio"] == 0.5
    assert (r["expired"], r["killed_after_start"], r["completed"]) == (1, 1, 2)
    # from the first arrival (1.0) to the last completion (6.0)
    assert r["duration_s"] == pytest.approx(5.0)
    assert r["request_throughput"] == pytest.approx(2 / 5.0)
    assert r["token_throughput"] == pytest.approx(9 / 5.0)
    assert r["normalized_latency_ms"]["median"] == pytest.approx(1125.0)
    assert r["normalized_latency_ms"]["p99"] == pytest.approx(1000 + 250 * 0.99)
    assert r["num_preemptions"] == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_das_beats_fcfs_on_utility_when_saturated(seed):
    """TCB's claim on a small overloaded TCB-like trace (about twice what 8 rows serve):
    DAS 1.4-1.6x FCFS's utility, and 8-14% above SJF's and EDF's, over seeds 0-7."""
    cost = CostModel(c0=0.005, c_prefill=2e-5, c_decode=5e-4)
    trace = workload("tcb", 400, rate=60.0, per_token_s=0.006, seed=seed, variance=100.0)
    utility = {}
    for policy in ("fcfs", "das", "sjf", "edf"):
        r = sweep_report(simulate(trace, policy, spec(8, tokens=256, kv_tokens=8192), cost))
        utility[policy] = r["utility"]
        if policy == "fcfs":
            assert r["hit_ratio"] < 0.8  # saturated: FCFS misses many deadlines
    assert utility["das"] > 1.2 * utility["fcfs"]
    assert utility["das"] > max(utility["sjf"], utility["edf"])


def test_step_features_classify_rows():
    step = StepInput(rows=[0, 1, 2, 3], context_lens=[0, 16, 5, 0], query_lens=[7, 4, 1, 1],
                     sample=[True] * 4, token_ids=[1] * 13)
    # row 0: prompt; row 1: a prompt chunk after 16 cached tokens; row 2: a decode;
    # row 3: a one-token prompt (no context, so not a decode)
    assert step_features(step) == StepFeatures(prefill_tokens=12, prefill_requests=3,
                                               decode_requests=1, context_tokens=21,
                                               prefill_attention_pairs=7 * 7 + 4 * 20 + 1)


def test_calibration_steps_have_the_grid_shape():
    f = step_features(synthetic_step((2, 8, 3, 16), block_size=4, setup=False))
    assert f == StepFeatures(16, 2, 3, 48, 2 * 64)
    setup = synthetic_step((2, 8, 3, 16), block_size=4, setup=True)
    assert len(setup.new_requests) == 5 and len(setup.table_blocks) == 2 * 2 + 3 * 5
    timed = synthetic_step((2, 8, 3, 16), block_size=4, setup=False)
    assert len(timed.new_requests) == 2  # the decodes are running requests


def test_fit_recovers_known_coefficients_and_selects_terms_that_matter():
    rng = random.Random(0)
    true = CostModel(c0=0.002, c_prefill=3e-5, c_decode=4e-4, c_ctx=8e-7)
    feats = [StepFeatures(prefill_tokens=p, prefill_requests=min(p, 1),
                          decode_requests=d, context_tokens=d * c,
                          prefill_attention_pairs=p * p)
             for p in (0, 16, 64, 256) for d in (0, 1, 8, 32) for c in (16, 200, 600)]
    times = [true.step_time(f) for f in feats]
    exact = fit(feats, times, ("c0", "c_prefill", "c_decode", "c_ctx"))
    assert exact.coefs["c_decode"] == pytest.approx(4e-4, rel=1e-6)
    assert exact.coefs["c_ctx"] == pytest.approx(8e-7, rel=1e-6) and exact.r2 > 0.999999
    noisy = [t * (1 + rng.uniform(-0.01, 0.01)) for t in times]
    chosen, _ = select(feats, noisy)
    assert "c_ctx" in chosen.terms  # context time is large here: it must enter
    assert "c_prefill_req" not in chosen.terms and "c_prefill_attn" not in chosen.terms
