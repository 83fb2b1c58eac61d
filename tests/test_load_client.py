"""The load client against a fake streaming server: the timings it measures, its pacing,
and a run dealt to several processes."""
from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from load_tests import sender
from load_tests.load_client import (LoadConfig, main, schedule, sweep, trace_size,
                                    units_needed)
from load_tests.metrics import SLO
from load_tests.traces import TraceRequest, arrival_times
from tests.http_thread import ServerThread

TTFT_S, ITL_S = 0.25, 0.05


class FakeStreamingServer:
    """/v1/completions that streams one token every `itl_s` after TTFT_S; prompt [999] fails."""

    def __init__(self, itl_s: float = ITL_S):
        self.itl_s = itl_s
        self.arrivals: list[float] = []
        self.prompts: list[list[int]] = []
        self.app = Starlette(routes=[Route("/v1/completions", self.completions,
                                           methods=["POST"])])

    async def completions(self, request):
        self.arrivals.append(time.perf_counter())
        body = await request.json()
        self.prompts.append(body["prompt"])
        ok = (body.get("ignore_eos") is True and body.get("stream") is True
              and body.get("stream_options") == {"include_usage": True}
              and body.get("temperature") == 0.0
              and all(isinstance(t, int) for t in body["prompt"]))
        if not ok:
            return JSONResponse({"error": {"message": f"bad body {body}"}}, status_code=400)
        if body["prompt"] == [999]:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def events():
            await asyncio.sleep(TTFT_S)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(self.itl_s)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f'w{i}'}]})}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


def test_load_client_measures_the_timings_the_server_produces():
    server = FakeStreamingServer()
    trace = [TraceRequest([1, 2, 3], 4), TraceRequest([5] * 7, 6), TraceRequest([999], 5),
             TraceRequest([4, 4], 8)]
    with ServerThread(server.app) as url:
        cfg = LoadConfig(url, num_warmup=0, show_progress=False, slo=SLO(ttft_ms=1000),
                         keep_samples=True)
        [res] = asyncio.run(sweep(cfg, trace, [math.inf]))
    assert (res["completed"], res["failed"]) == (3, 1)
    assert res["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    assert res["total_output_tokens"] == 18 and res["total_prompt_tokens"] == 12
    tol = 60  # ms: scheduling noise of a shared 2-core machine
    assert abs(res["ttft_ms"]["median"] - TTFT_S * 1e3) < tol
    assert abs(res["itl_ms"]["median"] - ITL_S * 1e3) < 25
    assert abs(res["tpot_ms"]["median"] - ITL_S * 1e3) < 25
    e2e = sorted(TTFT_S + (n - 1) * ITL_S for n in (4, 6, 8))  # 0.40, 0.50, 0.60 s
    assert abs(res["e2e_latency_ms"]["median"] - e2e[1] * 1e3) < tol
    norm = sorted((TTFT_S + (n - 1) * ITL_S) / n for n in (4, 6, 8))
    assert abs(res["normalized_latency_ms"]["median"] - norm[1] * 1e3) < tol / 4
    # all sent at t=0 and done after the longest request; every success met the TTFT SLO
    assert abs(res["duration_s"] - e2e[-1]) < 0.1
    assert res["goodput"] == pytest.approx(3 / res["duration_s"])
    # each success's own TTFT and normalized latency, when asked for (ms)
    # (the server waits at least TTFT_S and ITL_S: lower bounds hold on a busy machine)
    samples = res["samples_ms"]
    assert len(samples["ttft"]) == len(samples["normalized_latency"]) == 3
    assert min(samples["ttft"]) >= TTFT_S * 1e3 - 1
    assert all(x >= n * 1e3 - 1 for x, n in zip(sorted(samples["normalized_latency"]), norm))
    assert sorted(samples["ttft"])[1] == pytest.approx(res["ttft_ms"]["median"], abs=0.01)
    assert all(0 <= t < 0.1 for t in samples["sent_s"])  # all sent at the start


def test_load_client_paces_requests_at_the_offered_rate():
    server = FakeStreamingServer()
    trace = [TraceRequest([1], 1)]
    with ServerThread(server.app) as url:
        cfg = LoadConfig(url, num_warmup=0, duration_s=0.9, show_progress=False, seed=7)
        [res] = asyncio.run(sweep(cfg, trace, [10.0]))
    expected = [t for t in arrival_times(9, 10.0, seed=7) if t <= 0.9]
    assert res["completed"] == len(server.arrivals) == len(expected) and res["rate"] == 10.0
    sent = [t - server.arrivals[0] for t in server.arrivals]
    # (within 80 ms: sent all at once, or at a uniform 10/s, they would be off by 370 ms or
    # 430 ms; 30 ms was once missed by 5 ms under two busy test workers)
    assert max(abs(a - b) for a, b in zip(sent, expected)) < 0.08


def test_load_client_processes_share_one_start_and_merge_their_outcomes(monkeypatch):
    monkeypatch.setattr(sender, "PROCESS_START_S", 3.0)
    server = FakeStreamingServer()
    trace = [TraceRequest([1], 1), TraceRequest([999], 2), TraceRequest([2, 3], 3)]
    with ServerThread(server.app) as url:
        cfg = LoadConfig(url, num_warmup=0, duration_s=0.9, show_progress=False, seed=7,
                         processes=2)
        called = time.perf_counter()
        [res] = asyncio.run(sweep(cfg, trace, [10.0]))
        # each unit's result comes back in its place in the plan
        plan = [(0.01 * i, TraceRequest([7] * (i + 1), 1)) for i in range(5)]
        results, pending, _, _ = asyncio.run(sender.send_in_processes(cfg, plan))
    assert pending == 0 and [o.prompt_len for o in results] == [1, 2, 3, 4, 5]
    assert server.arrivals[0] - called > sender.PROCESS_START_S - 0.1  # the common start
    offsets = [t for t in arrival_times(9, 10.0, seed=7) if t <= 0.9]
    failing = sum(1 for i in range(len(offsets)) if i % 3 == 1)  # prompt [999]: HTTP 500
    assert (res["completed"], res["failed"]) == (len(offsets) - failing, failing)
    assert res["total_output_tokens"] == sum((1, 0, 3)[i % 3] for i in range(len(offsets)))
    # requests dealt to two processes still arrive at the plan's offsets from one start
    sent = sorted(server.arrivals)[:len(offsets)]
    assert max(abs(a - sent[0] - b) for a, b in zip(sent, offsets)) < 0.05


def test_schedule_respects_duration_and_caps():
    trace = [TraceRequest([1], 1, arrival_s=t) for t in (0.0, 0.5, 2.0)]
    cfg = LoadConfig("http://x", duration_s=1.0)
    assert [t for t, _ in schedule(trace, "trace", cfg)] == [0.0, 0.5]
    plan = schedule(trace, 50.0, cfg)
    assert 40 <= len(plan) <= 50 and all(t <= 1.0 for t, _ in plan)
    assert len(schedule(trace, 50.0, LoadConfig("http://x", max_requests=7))) == 7


def test_each_run_of_a_sweep_sends_prompts_no_earlier_run_sent(capsys):
    """A repeated prompt would be served from the server's prefix cache: the runs of one
    sweep take the trace's next requests, and a generated trace covers every run."""
    server = FakeStreamingServer(itl_s=0.001)  # ORCA's long outputs: only arrivals count
    orca = ["--trace", "orca", "--duration", "0.5", "--warmup", "0", "--no-progress"]
    with ServerThread(server.app) as url:
        main(["--url", url, *orca, "--vocab-size", "50000", "--rates", "20,30"])
        assert "prompts repeat" not in capsys.readouterr().err
        sent = len(server.prompts)
        assert sent >= 20  # ~10 + ~15 requests
        assert len({tuple(p) for p in server.prompts}) == sent
        # a trace shorter than the runs is cycled, and the client says so
        main(["--url", url, *orca, "--num-prompts", "3", "--rates", "20"])
        assert "prompts repeat" in capsys.readouterr().err
        assert len({tuple(p) for p in server.prompts[sent:]}) == 3
        # "inf" sends the whole trace: after another run it wraps round, and says so
        main(["--url", url, *orca, "--num-prompts", "12", "--rates", "20,inf"])
        assert "the run at rate inf sent prompts that were sent before" in \
            capsys.readouterr().err


def test_the_generated_trace_covers_every_run():
    cfg = LoadConfig("http://x", duration_s=10.0)
    # 20 + ceil(2.5); an uncapped "inf" sends the trace itself, "trace" replays it
    assert units_needed([2.0, 0.25, math.inf, "trace"], cfg) == 23
    assert units_needed([2.0, math.inf], LoadConfig("http://x", max_requests=5)) == 10
    assert trace_size("orca", [200.0, 300.0], cfg, turns=5) == 5000
    assert trace_size("multi-turn", [200.0], cfg, turns=5) == 10000  # 2000 conversations
    assert trace_size("orca", [1.0], cfg, turns=5) == 1000  # at least 1000
    assert trace_size("tcb", [200.0, "trace"], cfg, turns=5) == 1000  # its own length
