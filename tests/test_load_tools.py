"""The load tooling: traces against their stated distributions, metrics on hand-computed
examples, reports, and the transformers HTTP baselines against per-request model.generate
(the load client against a fake server: test_load_client.py)."""
from __future__ import annotations

import asyncio
import json
import math
import statistics

import numpy as np
import pytest

from load_tests.load_client import LoadConfig, sweep
from load_tests.metrics import (SLO, RequestOutcome, distribution, percentile, ratio_interval,
                                summarize,
                                worst_ttft_per_second)
from load_tests.report import load_reports, markdown_table, plot, sustained_rate
from load_tests.traces import (arrival_times, load_jsonl, multi_turn_trace,
                               orca_trace, save_jsonl, shared_prefix_trace, sharegpt_trace,
                               tcb_trace)
from tests.http_thread import ServerThread


# ---------------------------------------------------------------- traces

def test_arrivals_are_poisson_or_gamma_at_the_rate():
    for burstiness, cv2 in [(1.0, 1.0), (0.25, 4.0)]:
        t = arrival_times(20000, rate=10.0, burstiness=burstiness, seed=1)
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert t[0] == 0.0 and statistics.fmean(gaps) == pytest.approx(0.1, rel=0.04)
        assert statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2 == pytest.approx(
            cv2, rel=0.12)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(50, 5.0, seed=3) == arrival_times(50, 5.0, seed=3)


@pytest.mark.parametrize("variance, var_range", [(20, (18, 22)), (100, (85, 102))])
def test_tcb_trace(variance, var_range):
    trace = tcb_trace(20000, rate=50.0, variance=variance, vocab_size=300, seed=0,
                      per_token_s=0.01)
    for lengths in ([len(r.prompt_token_ids) for r in trace], [r.max_tokens for r in trace]):
        assert min(lengths) >= 3 and max(lengths) <= 100
        assert statistics.fmean(lengths) == pytest.approx(20, abs=0.5)
        assert var_range[0] <= statistics.pvariance(lengths) <= var_range[1]
    slack = [r.deadline_s / ((len(r.prompt_token_ids) + r.max_tokens) * 0.01) for r in trace]
    assert 1.5 <= min(slack) and max(slack) <= 4.0
    assert statistics.fmean(slack) == pytest.approx(2.75, abs=0.03)  # U(1.5, 4)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.04)
    assert all(0 <= t < 300 for r in trace[:50] for t in r.prompt_token_ids)


def test_sharegpt_trace_is_long_tailed_and_capped():
    trace = sharegpt_trace(20000, vocab_size=256, seed=0, max_context=2048)
    prompts = [len(r.prompt_token_ids) for r in trace]
    outputs = [r.max_tokens for r in trace]
    assert statistics.fmean(prompts) == pytest.approx(160, rel=0.08)
    assert statistics.fmean(outputs) == pytest.approx(340, rel=0.08)
    assert all(p + o <= 2048 and p >= 4 and o >= 1 for p, o in zip(prompts, outputs))
    # long tail: the mean is well above the median, and p99 far above it
    assert statistics.median(outputs) < 0.8 * statistics.fmean(outputs)
    assert sorted(outputs)[int(0.99 * len(outputs))] > 4 * statistics.median(outputs)


def test_traces_are_seeded_and_round_trip_through_jsonl(tmp_path):
    assert orca_trace(20, 100, seed=4) == orca_trace(20, 100, seed=4)
    assert orca_trace(20, 100, seed=4) != orca_trace(20, 100, seed=5)
    orca = orca_trace(200, 100, seed=0)
    assert all(32 <= len(r.prompt_token_ids) <= 512 and 1 <= r.max_tokens <= 128 for r in orca)
    for trace, has_deadlines in [(orca[:5], False), (tcb_trace(5, seed=2), True),
                                 (sharegpt_trace(5, seed=2), False)]:
        path = tmp_path / "t.jsonl"
        save_jsonl(trace, str(path))
        assert load_jsonl(str(path)) == trace
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 5 and all(("deadline_s" in r) == has_deadlines for r in rows)


# ---------------------------------------------------------------- metrics (hand-computed)

def test_percentile_interpolates_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 99) == 7.0
    assert distribution([0.010, 0.030]) == pytest.approx(
        {"mean": 20.0, "median": 20.0, "p90": 28.0, "p99": 29.8})
    assert distribution([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_on_a_hand_computed_run():
    a = RequestOutcome(20, 10, deadline_s=1.5, is_success=True, ttft_s=0.1, latency_s=1.0,
                       num_output_tokens=10, itl_s=[0.1] * 9)
    b = RequestOutcome(40, 5, deadline_s=2.0, is_success=True, ttft_s=0.3, latency_s=2.3,
                       num_output_tokens=5, itl_s=[0.5] * 4)
    c = RequestOutcome(30, 8, deadline_s=10.0, error="HTTP 500: boom")
    s = summarize([a, b, c], duration_s=4.0, slo=SLO(ttft_ms=200, tpot_ms=200))
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 3.75
    assert s["total_token_throughput"] == 18.75  # (20 + 40 + 10 + 5) / 4
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})
    assert s["tpot_ms"]["median"] == pytest.approx(300)  # a: 0.9/9, b: 2.0/4
    assert s["itl_ms"]["median"] == pytest.approx(100)  # nine 0.1 s gaps, four 0.5 s
    assert s["e2e_latency_ms"]["mean"] == pytest.approx(1650)
    assert s["normalized_latency_ms"]["median"] == pytest.approx(280)  # 100 and 460 ms/tok
    assert s["goodput"] == 0.25 and s["slo_attainment"] == pytest.approx(1 / 3)  # only a
    assert s["deadline_met"] == pytest.approx(1 / 3)  # a met, b late, c failed
    assert s["num_short_outputs"] == 0
    assert s["errors"] == [{"error": "HTTP 500: boom", "count": 1}]


def test_ratio_interval_separates_a_real_change_from_noise():
    rng = np.random.default_rng(1)
    before = rng.exponential(50.0, 2000)
    # the same distribution again: the interval holds 1 and is not narrow at the p99
    ratio, low, high = ratio_interval(before, rng.exponential(50.0, 2000), 99, resamples=500)
    assert low < 1.0 < high and high - low > 0.1
    # every value 1.5x: the interval is around 1.5 and excludes 1.1
    ratio, low, high = ratio_interval(before, 1.5 * before, 50, resamples=500)
    assert ratio == pytest.approx(1.5) and 1.1 < low <= 1.5 <= high < 1.9
    # requests sent in the same second share a slowdown: resampling seconds, not single
    # requests, gives the wider interval that such runs need, and it still holds 1
    seconds = np.repeat(np.arange(50), 40)
    slow = [np.exp(rng.normal(0.0, 0.5, 50))[seconds] * rng.exponential(50.0, 2000)
            for _ in range(2)]
    _, low, high = ratio_interval(*slow, 50, resamples=500)
    _, block_low, block_high = ratio_interval(*slow, 50, blocks=(seconds, seconds),
                                              resamples=500)
    assert block_high - block_low > 1.5 * (high - low) and block_low < 1.0 < block_high


def test_worst_ttft_per_second_finds_the_stalled_second():
    # run clock starts at 100 s; sent at 100.2 (ttft 30 ms), 101.5 (900 ms), 101.9 (40 ms),
    # 103.0 (20 ms); one failure is left out; nothing was sent in the third second
    sent = [(0.2, 0.03), (1.5, 0.9), (1.9, 0.04), (3.0, 0.02)]
    ok = [RequestOutcome(10, 4, is_success=True, ttft_s=ttft, latency_s=0.5,
                         end_s=100.0 + t + 0.5) for t, ttft in sent]
    failed = RequestOutcome(10, 4, error="HTTP 503", end_s=101.0)
    assert worst_ttft_per_second(ok + [failed], start_s=100.0) == [30.0, 900.0, None, 20.0]
    assert worst_ttft_per_second([failed], start_s=100.0) == []


def test_shared_prefix_and_multi_turn_traces(tmp_path):
    trace = shared_prefix_trace(50, vocab_size=300, seed=1, prefix_len=2000)
    system = trace[0].prompt_token_ids[:2000]
    assert all(r.prompt_token_ids[:2000] == system and 90 <= len(r.prompt_token_ids) - 2000
               <= 110 and r.max_tokens == 128 for r in trace)
    questions = {tuple(r.prompt_token_ids[2000:]) for r in trace}
    assert len(questions) == 50  # distinct questions
    turns = multi_turn_trace(12, vocab_size=300, seed=1, turns=5)
    assert len(turns) == 15 and [r.conversation for r in turns] == [i // 5 for i in range(15)]
    assert all(80 <= len(r.prompt_token_ids) <= 120 for r in turns)
    save_jsonl(turns, tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl") == turns


# ---------------------------------------------------------------- reports

def _report(system: str, points: list[tuple[float, float, float]]) -> dict:
    return {"system": system, "runs": [
        {"rate": rate, "completed": 10, "failed": 0, "request_throughput": x,
         "output_throughput": 100.0, "normalized_latency_ms": {"median": y, "p99": y}}
        for rate, x, y in points]}


def test_sustained_rate_is_interpolated_at_twice_the_unloaded_latency():
    s = sustained_rate(_report("a", [(1, 0.9, 10), (2, 1.8, 12), (4, 3.0, 30)])["runs"])
    assert s["baseline_ms"] == 10 and s["threshold_ms"] == 20
    assert s["rate"] == pytest.approx(2 + 2 * 8 / 18) and not s["is_lower_bound"]
    assert s["throughput"] == pytest.approx(1.8 + 1.2 * 8 / 18)
    never = sustained_rate(_report("b", [(1, 1, 10), (8, 7, 15)])["runs"])
    assert never["rate"] == 8 and never["is_lower_bound"]
    dead = _report("c", [(1, 1, 10), (2, 2, 11), (4, 0, 0)])
    dead["runs"][2]["completed"] = 0
    assert sustained_rate(dead["runs"])["rate"] == 2


def test_plot_and_table_from_several_results(tmp_path):
    paths = []
    for name, report in [("a1", _report("orca", [(4, 3.9, 20), (1, 1.0, 10)])),
                         ("a2", _report("orca", [(8, 7.5, 25)])),
                         ("b", _report("hf-cb", [(1, 0.95, 30), (2, 1.5, 90)]))]:
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    reports = load_reports([str(p) for p in paths])
    assert [r["system"] for r in reports] == ["orca", "hf-cb"]
    fig = plot(reports, str(tmp_path / "fig.png"))
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(lines["orca"].get_xdata()) == [1.0, 3.9, 7.5]  # sorted by rate, merged
    assert list(lines["orca"].get_ydata()) == [10, 20, 25]
    assert list(lines["hf-cb"].get_ydata()) == [30, 90]
    table = markdown_table(reports)
    assert "| orca | 8 | 10/0 | 7.50 | 100 |" in table and table.count("\n") == 6


# ---------------------------------------------------------------- transformers HTTP baselines

@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoTokenizer

    from engine_actors.checkpoint import resolve_model_path
    from load_tests.bench_offline import load_hf_model
    return (load_hf_model("tiny-random-llama", "cpu"),
            AutoTokenizer.from_pretrained(resolve_model_path("tiny-random-llama")))


@pytest.mark.parametrize("mode", ["static", "cb"])
def test_hf_server_matches_generate_and_serves_the_load_client(hf_model, mode):
    import httpx
    import torch

    from load_tests.hf_backends import ContinuousBackend, StaticBackend
    from load_tests.hf_server import build_app
    model, tokenizer = hf_model
    backend = (StaticBackend(model, max_batch_size=4) if mode == "static" else
               ContinuousBackend(model, {"num_blocks": 16, "max_batch_tokens": 64}))
    app = build_app(backend, tokenizer, "tiny", model.config.vocab_size, 4096)
    trace = orca_trace(5, vocab_size=256, seed=3, prompt_len=(3, 20), output_len=(2, 9))
    with ServerThread(app, lifespan="on") as url:
        for r in trace[:2]:
            resp = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "ignore_eos": True})
            ids = torch.tensor([r.prompt_token_ids])
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=r.max_tokens, eos_token_id=-1,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
            assert resp.json()["choices"][0]["text"] == tokenizer.decode(
                ref, skip_special_tokens=True)
            assert resp.json()["usage"]["completion_tokens"] == r.max_tokens
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "temperature": 0.7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        cfg = LoadConfig(url, num_warmup=1, show_progress=False)
        [res] = asyncio.run(sweep(cfg, trace, [math.inf]))
    assert res["completed"] == 5 and res["num_short_outputs"] == 0
    assert res["total_output_tokens"] == sum(r.max_tokens for r in trace)


def test_finetune_report_reads_a_run_and_plots(tmp_path):
    from load_tests import finetune_report
    run = {"args": {"busy_share": 0.1}, "loaded_tokens_s": 900.0, "dedicated_tokens_s": 9000.0,
           "serve": {"normalized_latency_ms": {"median": 8.0}},
           "serve+ft": {"normalized_latency_ms": {"median": 9.6}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert finetune_report.point(str(path)) == pytest.approx((0.1, 0.1, 1.2))
    finetune_report.main([str(path), "--out", str(tmp_path / "f.png")])
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_finetune_table_says_how_long_runs_of_pieces_took_to_stop():
    from load_tests.finetune_report import table
    phase = {"ttft_ms": {"p99": 40.0}, "normalized_latency_ms": {"median": 6.0}}
    run = {"serve": phase, "serve+ft": phase, "dedicated_tokens_s": 10000.0,
           "loaded_tokens_s": 5000.0, "idle_tokens_s": 9500.0,
           "finetuning_health": {"stop_wait_ms": {"count": 3, "p50": 10.5, "p99": 30.1,
                                                  "max": 32.0}}}
    text = table(run)
    assert "| on the server, no load | 9500 | 0.95 |" in text
    assert "stopped for a request: 3, in 10.5 / 30.1 / 32.0 ms" in text
    del run["finetuning_health"]
    assert "stopped" not in table(run)
