"""Data parallelism's router (deployments/engines.py) over fake engines: where requests go,
and /health and /metrics of several engines in one."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.engine_client import EngineFailed, EngineUnavailable, RequestRefused
from deployments.engines import BALANCE, RETRY_S, SHARE_S, Engines
from deployments.merged_replies import (merged_batch_status, merged_health, merged_metrics,
                                        merged_streams)
from engine_actors.config import ConfigError, EngineConfig
from engine_actors.messages import EngineRequest, Refusal
from engine_actors.metrics import EngineMetrics
from engine_actors.prefix_log import PrefixLog
from engine_actors.request import SamplingParams


class FakeEngine:
    def __init__(self, rank: int):
        self.rank, self.num_unfinished, self.ended, self.calls = rank, 0, [], []
        self.is_connected, self.connects, self.fails, self.full = True, 0, False, False
        self.info, self.adapters, self.log, self.results, self.status = None, {}, None, [], None

    async def connect(self):
        self.connects += 1
        if self.fails:
            raise EngineFailed("no GPU")
        self.is_connected = True

    async def submit(self, requests, wake_each_update=True):
        if self.full:
            raise RequestRefused(Refusal("queue_full", "full"))
        self.num_unfinished += len(requests)
        return self.rank

    def end_search(self, search):
        self.ended.append(search)

    async def close(self, final=True):
        pass

    async def stream_call(self, method, *args):
        for item in self.results:
            await asyncio.sleep(0)
            yield item

    async def call(self, method, *args):
        self.calls.append((method, *args))
        if method == "batch_call":
            return self.status
        if method == "health":
            return {"state": "ready", "workers_alive": True, "num_blocks": 10}
        if args[:1] == ("paths",):
            return dict(self.adapters)
        if args[:1] == ("load",) and len(args) == 3:
            self.adapters[args[1]] = args[2]
        if method == "share_prefixes":
            return self.log.share(*args)
        if method == "submit_batch":
            return Refusal("too_long", "request 4: too long") if len(args[1]) > 3 else None
        return f"refused by {self.rank}" if args[-1:] == ("bad",) and self.rank == 1 else None


def engines(n: int = 2, **args) -> Engines:
    router = Engines(EngineConfig.from_args({"data_parallel_size": n, "block_size": 4,
                                             **args}))
    router.clients = [FakeEngine(rank) for rank in range(n)]
    return router


def request(ids, search=None, salt="", lora=None) -> EngineRequest:
    return EngineRequest("r", list(ids), SamplingParams(max_tokens=4), search=search, cache_salt=salt,
                         lora_name=lora)


def send(router: Engines, *requests) -> list[int]:
    return [asyncio.run(router.submit([r])) for r in requests]


def test_a_prompt_follows_its_prefix_and_others_go_to_the_least_busy():
    router = engines(3)
    chat = list(range(100, 140))  # ten blocks
    first = send(router, request(chat))[0]
    # new prompts go round the other engines (each has one request fewer)
    others = send(router, request(range(20)), request(range(30, 50)))
    assert sorted([first, *others]) == [0, 1, 2]
    # the conversation's next turns keep to their engine though it is as busy as the rest
    # (a round robin would move them); a prompt that shares only a part of the earlier
    # prompt (a system prompt) does not
    assert send(router, request(chat + [1, 2, 3, 4]), request(chat + [5] * 8)) == [first] * 2
    short = list(range(100, 108)) + list(range(20))  # its first 2 blocks are chat's
    loads = [c.num_unfinished for c in router.clients]
    rank = send(router, request(short))[0]
    assert loads[rank] == min(loads) < loads[first]


def test_a_prefix_gives_way_when_its_engine_is_too_busy():
    router = engines(2)
    chat = list(range(64))
    owner = send(router, request(chat))[0]
    router.clients[owner].num_unfinished = BALANCE  # the other has none: still within
    assert send(router, request(chat))[0] == owner
    router.clients[owner].num_unfinished = BALANCE + 1
    assert send(router, request(chat))[0] == 1 - owner
    # that engine now holds the prefix, as the last one sent it
    router.clients[owner].num_unfinished = 0
    assert send(router, request(chat))[0] == 1 - owner


def test_prefixes_are_apart_per_adapter_and_cache_salt():
    router = engines(2)
    chat = list(range(64))
    owner = send(router, request(chat))[0]
    prefixes = router.prefixes
    assert prefixes.match(prefixes.hashes(request(chat + [1]))) == owner
    for other in (request(chat, salt="s"), request(chat, lora="a")):
        assert prefixes.match(prefixes.hashes(other)) is None
    assert send(router, request(chat, salt="s"))[0] == 1 - owner  # (the least busy)
    assert prefixes.match(prefixes.hashes(request(chat, salt="s"))) == 1 - owner


def test_a_beam_search_stays_on_its_engine_until_it_ends():
    router = engines(2)
    rank = send(router, request(range(8), search="s1"))[0]
    router.clients[rank].num_unfinished = 100
    assert send(router, request(range(40), search="s1")) == [rank]  # its next step
    router.end_search("s1")
    assert router.clients[rank].ended == ["s1"] and not router.clients[1 - rank].ended
    assert send(router, request(range(40), search="s1")) == [1 - rank]  # forgotten


def test_an_engine_that_died_is_skipped_while_it_is_brought_up_again():
    router = engines(2)
    chat = list(range(64))
    owner = send(router, request(chat))[0]
    router.clients[owner].is_connected = False

    async def scenario():
        sent = [await router.submit([request(chat)]) for _ in range(3)]
        await asyncio.sleep(0)  # the reconnection runs
        return sent + [await router.submit([request(range(100, 164))])]

    assert asyncio.run(scenario()) == [1 - owner] * 3 + [owner]  # (the least busy again)
    assert router.clients[owner].connects == 1


def test_a_full_queue_sends_the_request_to_another_engine():
    router = engines(3)
    router.clients[0].full = router.clients[1].full = True
    assert send(router, request(range(8)), request(range(9))) == [2, 2]
    router.clients[2].full = True
    with pytest.raises(RequestRefused):
        send(router, request(range(10)))


def test_an_engine_that_does_not_come_back_is_tried_at_growing_intervals():
    router = engines(2)
    router.clients[1].is_connected, router.clients[1].fails = False, True

    async def scenario():
        for _ in range(20):
            await router.submit([request(range(8))])
            await asyncio.sleep(0)
        return router.clients[1].connects, router._retry[1]

    connects, (next_try, wait) = asyncio.run(scenario())
    assert connects == 1 and wait == 2 * RETRY_S[0]  # one try, the next one later
    health = asyncio.run(router.call("health"))
    assert health["state"] == "unavailable" and not health["workers_alive"]
    assert health["engines"][1]["reason"] == "not connected" and health["num_blocks"] == 10


def test_an_engine_that_comes_back_gets_the_adapters_loaded_at_run_time():
    router = engines(2, enable_lora=True)
    router.clients[0].adapters = {"sql": "/a/sql", "chat": "/a/chat"}
    router.clients[1].adapters = {"sql": "/a/sql"}  # (a configured one)
    router.clients[1].is_connected = False

    async def scenario():
        await router.submit([request(range(8))])
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert router.clients[1].adapters == {"sql": "/a/sql", "chat": "/a/chat"}
    assert ("adapter_call", "load", "sql", "/a/sql") not in router.clients[1].calls
    assert asyncio.run(router.call("adapter_call", "paths")) == router.clients[0].adapters


def test_replicas_learn_the_routes_the_others_took():
    """A conversation's next turn that reaches another replica goes to the same engine
    once the replicas have shared their routes (through the first engine's PrefixLog)."""
    first, second = engines(2), engines(2)
    log = PrefixLog()
    second.clients = first.clients  # the same two engines
    first.clients[0].log = log
    chat = list(range(200, 240))

    async def scenario():
        owner = await first.submit([request(chat)])
        other = 1 - owner
        first.clients[owner].num_unfinished = first.clients[other].num_unfinished = 5
        second._turn = other - 1  # the next request without a prefix would go to `other`
        before = await second.submit([request(chat + [1] * 8)])
        await asyncio.sleep(SHARE_S * 2.5)  # both shared their routes
        first.clients[owner].num_unfinished = first.clients[other].num_unfinished = 5
        second._turn = other - 1
        after = await second.submit([request(chat + [2] * 8)])
        await first.close(), await second.close()
        return owner, before, after

    owner, before, after = asyncio.run(scenario())
    assert before == 1 - owner and after == owner


def test_the_prefix_log_gives_each_replica_the_others_entries_once():
    log = PrefixLog(capacity=4)
    i = log.id
    assert log.share("a", [(1, 0), (2, 1)], None, 0) == (i, 2, [])
    assert log.share("b", [(3, 0)], None, 0) == (i, 3, [(1, 0), (2, 1)])
    assert log.share("a", [], i, 2) == (i, 3, [(3, 0)])
    assert log.share("b", [], i, 3) == (i, 3, [])
    log.share("a", [(4, 1), (5, 1), (6, 0)], i, 3)  # the oldest two dropped
    assert log.share("c", [], i, 0) == (i, 6, [(3, 0), (4, 1), (5, 1), (6, 0)])
    # numbers of another log (the first engine was started again): all there is
    new = PrefixLog()
    new.share("b", [(7, 0), (8, 1), (9, 0)], None, 0)
    assert new.share("a", [], i, 2) == (new.id, 3, [(7, 0), (8, 1), (9, 0)])


def test_calls_go_to_the_first_engine_or_to_every_engine():
    router = engines(2)
    assert asyncio.run(router.call("response_call", "get", "x")) is None
    assert asyncio.run(router.call("adapter_call", "load", "a", "bad")) == "refused by 1"
    asyncio.run(router.call("drain", 1.0))
    assert router.clients[0].calls == [("response_call", "get", "x"),
                                       ("adapter_call", "load", "a", "bad"), ("drain", 1.0)]
    assert router.clients[1].calls == [("adapter_call", "load", "a", "bad"), ("drain", 1.0)]


def test_health_of_two_engines():
    one = {"state": "ready", "workers_alive": True, "heartbeat_age_s": 0.1,
           "num_requests": 2, "num_free_blocks": 10, "num_blocks": 20, "kv_usage": 0.5,
           "stored_responses": 3, "prefix_cache_hit_rate": 0.25}
    two = {**one, "heartbeat_age_s": 0.3, "num_requests": 1, "num_free_blocks": 30,
           "num_blocks": 40, "kv_usage": 0.25, "stored_responses": 0,
           "prefix_cache_hit_rate": 0.75}
    health = merged_health([one, two])
    assert (health["num_requests"], health["num_free_blocks"], health["num_blocks"]) == \
        (3, 40, 60)
    assert health["heartbeat_age_s"] == 0.3 and health["state"] == "ready"
    assert health["kv_usage"] == pytest.approx((10 + 10) / 60)
    assert health["prefix_cache_hit_rate"] == 0.5
    assert health["stored_responses"] == 3  # the first engine's stores
    assert health["engines"] == [one, two] and health["data_parallel_size"] == 2
    down = merged_health([one, {**two, "state": "recovering", "workers_alive": False}])
    assert down["state"] == "recovering" and not down["workers_alive"]


def test_metrics_of_two_engines_parse_as_one_exposition():
    texts = []
    for rank, tokens in ((0, 5), (1, 7)):
        metrics = EngineMetrics("m", rank)
        metrics.generation_tokens.inc(tokens)
        metrics.finished("length", 3, tokens)
        texts.append(metrics.render())
    text = merged_metrics(texts).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# HELP orca:generation_tokens_total") == 1
    tokens = {s.labels["engine"]: s.value for s in families["orca:generation_tokens"].samples
              if s.name == "orca:generation_tokens_total"}
    assert tokens == {"0": 5.0, "1": 7.0}
    finished = {s.labels["engine"] for s in families["orca:request_finished"].samples
                if s.labels.get("finished_reason") == "length" and s.value == 1.0}
    assert finished == {"0", "1"}


def test_fine_tuning_needs_one_engine():
    with pytest.raises(ConfigError, match="data_parallel_size 1"):
        EngineConfig.from_args({"data_parallel_size": 2, "enable_finetuning": True})


def test_a_batch_is_shared_out_over_the_engines_or_refused_whole():
    router = engines(2)
    assert asyncio.run(router.call("submit_batch", "b", list("abcde"), 1)) is None
    first, second = router.clients[router._turn % 2], router.clients[1 - router._turn % 2]
    assert first.calls == [("submit_batch", "b", ["a", "b", "c"], 1, 0, 5)]
    assert second.calls == [("submit_batch", "b", ["d", "e"], 1, 3, 5)]
    asyncio.run(router.call("submit_batch", "c", list("a"), 1))  # the next in turn
    assert second.calls[-1] == ("submit_batch", "c", ["a"], 1, 0, 1)
    router = engines(2)  # the second share is refused: the first one is cancelled
    router._turn = 1  # (the first share, of 4, on the first engine, which refuses it)
    refusal = asyncio.run(router.call("submit_batch", "b", list("abcdefg"), 1))
    assert refusal.message == "request 4: too long"
    assert router.clients[1].calls[-1] == ("batch_call", "cancel", "b")
    assert ("batch_call", "cancel", "b") not in router.clients[0].calls


def test_a_batch_status_and_results_from_its_shares():
    share = {"id": "b", "object": "orca.batch", "status": "completed", "num_requests": 2,
             "num_completed": 2, "num_failed": 0, "num_cancelled": 0, "created": 5}
    running = {**share, "status": "in_progress", "num_completed": 1, "created": 3}
    merged = merged_batch_status([share, running])
    assert (merged["status"], merged["num_requests"], merged["num_completed"],
            merged["created"]) == ("in_progress", 4, 3, 3)
    assert merged_batch_status([share, share])["status"] == "completed"
    failed = {**share, "status": "failed", "num_completed": 0, "num_failed": 2}
    assert merged_batch_status([share, failed])["status"] == "completed"
    assert merged_batch_status([failed, failed])["status"] == "failed"
    assert merged_batch_status([share, {**share, "status": "cancelled"}])["status"] == \
        "cancelled"
    assert merged_batch_status([]) is None
    # a share lost with its engine: its requests count as failed
    lost = merged_batch_status([{**share, "total": 5}])
    assert (lost["num_requests"], lost["num_failed"], lost["status"]) == (5, 3, "completed")
    assert "total" not in lost
    assert merged_batch_status([{**failed, "total": 4}])["status"] == "failed"

    async def items(values, delay, error=None):
        for v in values:
            await asyncio.sleep(delay)
            yield v
        if error:
            raise error

    async def collect(*streams):
        return [x async for x in merged_streams(list(streams))]

    assert asyncio.run(collect(items([1, 3], 0.01), items([2], 0.015))) == [1, 2, 3]
    with pytest.raises(KeyError):
        asyncio.run(collect(items([1], 0.01), items([], 0.0, KeyError("gone"))))


def test_batch_results_of_a_share_that_was_lost_end_in_an_error():
    router = engines(2)
    share = {"id": "b", "object": "orca.batch", "status": "in_progress", "num_requests": 2,
             "num_completed": 0, "num_failed": 0, "num_cancelled": 0, "created": 1,
             "total": 4}
    router.clients[0].status, router.clients[0].results = share, [["r0"], ["r1"]]
    router.clients[1].status, router.clients[1].results = {**share, "created": 2}, [["r2", "r3"]]

    async def read():
        return [r async for results in router.stream_call("batch_results", "b")
                for r in results]

    assert sorted(asyncio.run(read())) == ["r0", "r1", "r2", "r3"]
    router.clients[1].is_connected = False  # its engine stopped: its share is gone
    router._retry[1] = (float("inf"), 1.0)
    with pytest.raises(EngineUnavailable, match="2 results were lost"):
        asyncio.run(read())


def test_prefix_hashes_are_the_same_in_every_process():
    """The replicas share routes by these hashes: Python seeds str hashes per process."""
    code = ("from types import SimpleNamespace as r; "
            "from deployments.prefix_routes import PrefixOwners; "
            "print(PrefixOwners(4).hashes(r(prompt_token_ids=list(range(12)), "
            "cache_salt='s', lora_name='a')))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().count(",") == 2


def test_a_route_is_remembered_where_the_request_was_taken():
    router = engines(2)
    chat = list(range(300, 340))
    owner = send(router, request(chat))[0]
    router.clients[owner].full = True  # the next turn goes to the other one
    assert send(router, request(chat + [1] * 4)) == [1 - owner]
    router.clients[owner].full = False
    assert send(router, request(chat + [1] * 8)) == [1 - owner]  # where its prefix went
