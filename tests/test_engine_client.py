"""The ingress replica's side of the engine (deployments/engine_client.py, request_group.py),
without Ray: how outputs reach a request's reader, and how submissions are gathered into
add_requests calls."""
from __future__ import annotations

import asyncio
import types

import pytest

from deployments.engine_client import EngineClient, EngineUnavailable, RequestGroup
from engine_actors.config import EngineConfig
from engine_actors.messages import RequestUpdate


class FakeScheduler:
    """Records add_requests and abort calls; each add_requests answers when told to."""

    def __init__(self):
        self.adds: list[tuple[list[str], asyncio.Future]] = []
        self.aborts: list[list[str]] = []
        self.add_requests = types.SimpleNamespace(remote=self._add)
        self.abort = types.SimpleNamespace(remote=lambda ids, stopped=False:
                                           self.aborts.append(list(ids)))

    def _add(self, client_id, requests):
        answer = asyncio.get_running_loop().create_future()
        self.adds.append(([r.request_id for r in requests], answer))
        return answer

    def answer(self, call: int) -> None:
        ids, answer = self.adds[call]
        answer.set_result([None] * len(ids))


def group_of(*request_ids, wake_each_update=True):
    routes = {}
    return RequestGroup(routes, FakeScheduler(), list(request_ids), wake_each_update), routes


async def next_within(group, seconds=0.05):
    return await asyncio.wait_for(group.__anext__(), seconds)


def test_updates_that_arrive_while_the_reader_is_busy_come_as_one():
    async def run():
        group, routes = group_of("a", "b")
        group.put("a", RequestUpdate([1], num_cached_tokens=16))
        group.put("b", RequestUpdate([7]))
        group.put("a", RequestUpdate([2], num_cached_tokens=16))
        group.put("a", RequestUpdate([3], finish_reason="length", num_cached_tokens=16))
        rid, update = await next_within(group)
        assert (rid, update.token_ids, update.finish_reason) == ("a", [1, 2, 3], "length")
        assert update.num_cached_tokens == 16
        assert "a" not in routes and "b" in routes  # a has ended
        rid, update = await next_within(group)
        assert (rid, update.token_ids, update.finish_reason) == ("b", [7], None)
        with pytest.raises(asyncio.TimeoutError):  # nothing more until b's next update
            await next_within(group)
    asyncio.run(run())


def test_a_reader_of_ends_only_is_woken_once_with_every_token_and_when_they_came():
    async def run():
        group, _ = group_of("a", wake_each_update=False)
        for token in (5, 6):
            group.put("a", RequestUpdate([token]))
            await asyncio.sleep(0.01)
        with pytest.raises(asyncio.TimeoutError):
            await next_within(group)
        group.put("a", RequestUpdate([8, 9], finish_reason="stop"))
        rid, update = await next_within(group)
        assert (update.token_ids, update.finish_reason) == ([5, 6, 8, 9], "stop")
        arrivals = group.arrivals.pop("a")
        assert [count for _, count in arrivals] == [1, 1, 2]
        assert arrivals[0][0] < arrivals[1][0] < arrivals[2][0]
    asyncio.run(run())


def test_an_unreachable_engine_ends_the_read_even_after_tokens_were_merged():
    async def run():
        group, _ = group_of("a", wake_each_update=False)
        group.put("a", RequestUpdate([5]))
        group.put("a", RequestUpdate(finish_reason="abort", error="scheduler failed",
                                     unavailable=True))
        with pytest.raises(EngineUnavailable, match="scheduler failed"):
            await next_within(group)
    asyncio.run(run())


def test_submissions_made_while_an_add_is_in_flight_go_in_one_call():
    async def run():
        client = EngineClient(EngineConfig.from_args({}))
        scheduler = FakeScheduler()

        async def connected():
            return scheduler
        client._connected_actor = connected

        def request(rid):
            return types.SimpleNamespace(request_id=rid)

        first = asyncio.create_task(client.submit([request("a")]))
        await asyncio.sleep(0.01)
        assert [ids for ids, _ in scheduler.adds] == [["a"]]
        later = [asyncio.create_task(client.submit([request(r)])) for r in ("b", "c")]
        await asyncio.sleep(0.01)
        later.append(asyncio.create_task(client.submit([request("d"), request("e")])))
        await asyncio.sleep(0.01)
        assert len(scheduler.adds) == 1  # b..e wait for a's call to answer
        scheduler.answer(0)
        await asyncio.sleep(0.01)
        assert first.done() and not any(t.done() for t in later)
        assert [ids for ids, _ in scheduler.adds] == [["a"], ["b", "c", "d", "e"]]
        scheduler.answer(1)
        groups = await asyncio.gather(*later)
        assert [sorted(g.unfinished) for g in groups] == [["b"], ["c"], ["d", "e"]]
        assert scheduler.aborts == []
    asyncio.run(run())


def test_latency_metrics_of_a_deferred_reader_follow_when_tokens_came(tmp_path):
    """A non-streamed choice is consumed once, at its end; its TTFT, inter-token gaps and
    end-to-end latency still come from when each update reached the replica."""
    from deployments.http_metrics import HTTPMetrics, RequestTimer
    from deployments.choice import Choice
    from engine_actors.checkpoint import load_tokenizer, save_byte_tokenizer
    from engine_actors.detokenizer import TextStream
    save_byte_tokenizer(str(tmp_path))
    metrics = HTTPMetrics("m")
    start = 100.0
    choice = Choice(0, 0, TextStream(load_tokenizer(str(tmp_path))), [1, 2], None,
                    RequestTimer(metrics, start))
    merged = RequestUpdate([104, 105, 106, 107], finish_reason="length")
    choice.consume(merged, [(100.010, 1), (100.030, 1), (100.060, 2)])

    def observed(histogram):
        samples = {s.name: s.value for s in histogram.collect()[0].samples}
        return samples[histogram._name + "_count"], samples[histogram._name + "_sum"]

    assert observed(metrics.ttft) == pytest.approx((1, 0.010))
    # gaps: 20 ms, then two tokens that came together share 30 ms
    assert observed(metrics.itl) == pytest.approx((3, 0.020 + 0.015 + 0.015))
    assert observed(metrics.e2e) == pytest.approx((1, 0.060))
    assert observed(metrics.tpot) == pytest.approx((1, 0.050 / 3))


def test_request_metrics_of_several_replicas_add_up():
    """GET /metrics sums each series over the replicas' snapshots (deployments/http_metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    from deployments.http_metrics import HTTPMetrics, render_summed

    def parse(text):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text.decode()) for s in f.samples}

    replicas = [HTTPMetrics("m"), HTTPMetrics("m")]
    for metrics, ttfts in zip(replicas, [[0.003, 0.2], [0.03, 0.03, 7.0]]):
        for ttft in ttfts:
            metrics.ttft.observe(ttft)
            metrics.success("length")
    replicas[1].failure("timeout")
    one = parse(replicas[0].render())
    assert parse(render_summed([replicas[0].snapshot()])) == one
    summed = parse(render_summed([r.snapshot() for r in replicas]))

    def at(name, **labels):
        return summed[name, tuple(sorted({"model_name": "m", **labels}.items()))]
    assert at("orca:time_to_first_token_seconds_count") == 5
    assert at("orca:time_to_first_token_seconds_sum") == pytest.approx(7.263)
    assert at("orca:time_to_first_token_seconds_bucket", le="0.04") == 3
    assert at("orca:time_to_first_token_seconds_bucket", le="+Inf") == 5
    assert at("orca:request_success_total", finished_reason="length") == 5
    assert at("orca:request_failure_total", reason="timeout") == 1
