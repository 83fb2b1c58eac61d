from __future__ import annotations

import random

import pytest

from engine_actors.kv_cache import KVCacheManager
from engine_actors.policies import FCFS, Budget
from engine_actors.request import Request, RequestStatus, SamplingParams
from engine_actors.scheduler import RequestRejected, Scheduler
from tests.fake_runner import FakeRunner, expected_output

EOS = 198  # never produced by this workload unless ignore_eos is off and it comes up


def make_scheduler(num_blocks=64, block_size=4, max_batch=4, max_tokens=64, max_model_len=512):
    kv = KVCacheManager(num_blocks, block_size, max_batch)
    return Scheduler(kv, FCFS(), Budget(max_batch, max_tokens), max_model_len, {EOS})


def make_req(rid, prompt, max_tokens, t=0.0):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), t)


def run_step(sched, runner, outputs):
    batch = sched.schedule()
    if batch is None:
        return None
    for out in sched.process(batch, runner.execute(batch.step)):
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finish_reason:
            outputs[out.request_id + ":finish"] = out.finish_reason
    return batch


def test_fcfs_order_and_max_batch_size():
    sched, runner, outs = make_scheduler(max_batch=2), FakeRunner(4), {}
    for i in range(4):
        sched.add(make_req(f"r{i}", [i + 1] * 3, max_tokens=2 + i))
    batch = run_step(sched, runner, outs)
    assert [s.request.request_id for s in batch.scheduled] == ["r0", "r1"]
    batch = run_step(sched, runner, outs)
    assert [s.request.request_id for s in batch.scheduled] == ["r0", "r1"]
    # r0 finished (2 tokens) after the second iteration: r2 joins at the very next one
    assert outs["r0:finish"] == "length"
    batch = run_step(sched, runner, outs)
    assert [s.request.request_id for s in batch.scheduled] == ["r1", "r2"]
    while run_step(sched, runner, outs):
        pass
    for i in range(4):
        assert outs[f"r{i}"] == expected_output([i + 1] * 3, 2 + i)


def test_late_request_joins_next_iteration_mixed_with_decodes():
    sched, runner, outs = make_scheduler(), FakeRunner(4), {}
    sched.add(make_req("a", [5] * 6, max_tokens=10))
    run_step(sched, runner, outs)  # a: prefill
    run_step(sched, runner, outs)  # a: decode
    sched.add(make_req("b", [7] * 9, max_tokens=3))
    batch = run_step(sched, runner, outs)
    step = batch.step
    assert [s.request.request_id for s in batch.scheduled] == ["a", "b"]
    assert step.query_lens == [1, 9] and step.context_lens == [7, 0]  # decode + prefill together
    while run_step(sched, runner, outs):
        pass
    assert outs["a"] == expected_output([5] * 6, 10)
    assert outs["b"] == expected_output([7] * 9, 3)


def test_finished_request_leaves_at_once_and_frees_kv():
    sched, runner, outs = make_scheduler(num_blocks=16), FakeRunner(4), {}
    sched.add(make_req("short", [1] * 4, max_tokens=1))
    sched.add(make_req("long", [2] * 4, max_tokens=5))
    run_step(sched, runner, outs)
    assert outs["short:finish"] == "length" and "short" not in sched.pool
    long_req = sched.pool["long"]
    held = len(long_req.blocks) + long_req.num_reserved_blocks
    assert sched.kv.num_free_blocks - sched.kv.num_reserved_blocks == 16 - held
    batch = run_step(sched, runner, outs)
    assert [s.request.request_id for s in batch.scheduled] == ["long"]


def test_refuses_requests_that_can_never_fit():
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=100)
    with pytest.raises(RequestRejected, match="context length"):
        sched.add(make_req("ctx", [1] * 90, max_tokens=11))
    with pytest.raises(RequestRejected, match="KV cache capacity"):
        sched.add(make_req("kv", [1] * 30, max_tokens=3))  # 33 tokens > 32 slots
    sched.add(make_req("ok", [1] * 30, max_tokens=2))  # exactly 32
    assert list(sched.pool) == ["ok"]


def test_reservation_waits_instead_of_overcommitting():
    sched, runner, outs = make_scheduler(num_blocks=6, block_size=4), FakeRunner(4), {}
    sched.add(make_req("a", [1] * 8, max_tokens=8))  # 16 tokens: 4 blocks
    sched.add(make_req("b", [2] * 4, max_tokens=8))  # 12 tokens: 3 blocks, only 2 left
    batch = run_step(sched, runner, outs)
    assert [s.request.request_id for s in batch.scheduled] == ["a"]
    assert not sched.pool["b"].is_admitted
    while "a:finish" not in outs:
        run_step(sched, runner, outs)
    batch = run_step(sched, runner, outs)
    assert [s.request.request_id for s in batch.scheduled] == ["b"]


def test_abort_frees_kv_of_queued_and_in_flight_requests():
    sched, runner, outs = make_scheduler(num_blocks=20), FakeRunner(4), {}
    sched.add(make_req("run", [1] * 5, max_tokens=50))
    sched.add(make_req("other", [3] * 5, max_tokens=4))
    batch = sched.schedule()  # both in flight
    assert sched.pool["run"].status is RequestStatus.RUNNING
    out = sched.abort("run")
    assert out.finish_reason == "abort" and "run" not in sched.pool
    sampled = runner.execute(batch.step)
    results = sched.process(batch, sampled)  # the in-flight token of "run" is dropped
    assert [r.request_id for r in results] == ["other"]
    sched.add(make_req("queued", [4] * 5, max_tokens=4))
    assert sched.abort("queued").finish_reason == "abort"
    assert sched.abort("queued") is None  # twice is harmless
    while run_step(sched, runner, outs):
        pass
    assert sched.kv.num_free_blocks == 20 and sched.kv.num_reserved_blocks == 0
    assert sched.kv.num_free_rows == sched.kv.max_num_seqs


def test_long_prompt_is_chunked_while_decodes_continue():
    sched, runner, outs = make_scheduler(max_tokens=8), FakeRunner(4), {}
    sched.add(make_req("dec", [1] * 3, max_tokens=20))
    run_step(sched, runner, outs)
    sched.add(make_req("long", list(range(1, 30)), max_tokens=2))  # 29 prompt tokens
    chunks = []
    while "long" not in outs:
        batch = run_step(sched, runner, outs)
        assert batch.step.num_tokens <= 8
        assert batch.scheduled[0].request.request_id == "dec"  # a token every iteration
        chunks.append(batch.step.query_lens[1])
    assert chunks == [7, 7, 7, 7, 1]
    while run_step(sched, runner, outs):
        pass
    assert outs["long"] == expected_output(list(range(1, 30)), 2)


def test_overlapped_steps_continue_from_the_workers_last_sample():
    """Two steps in flight: a running request is scheduled again before its token is back."""
    sched, runner = make_scheduler(num_blocks=64, max_batch=4), FakeRunner(4)
    sched.allow_continuation = True
    outs, in_flight = {}, []
    prompts = {f"r{i}": [i + 3] * (2 + 3 * i) for i in range(5)}
    for rid, prompt in prompts.items():
        sched.add(make_req(rid, prompt, max_tokens=3 + int(rid[1:])))
    while sched.pool or in_flight:
        while len(in_flight) < 2 and (batch := sched.schedule()) is not None:
            in_flight.append((batch, runner.execute(batch.step)))
        batch, sampled = in_flight.pop(0)
        for out in sched.process(batch, sampled):
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, prompt in prompts.items():
        assert outs[rid] == expected_output(prompt, 3 + int(rid[1:]))  # never over max_tokens
    assert any(-1 in s.token_ids for s in runner.steps)
    assert sched.kv.num_free_blocks == 64 and sched.kv.num_reserved_blocks == 0


def test_pipeline_stride_keeps_the_steps_in_the_pipeline_disjoint_and_continues_behind():
    """P=2 stages with continuation: a request's consecutive steps are at least 2 apart (the
    two stages never hold the same request), and its next step is sent before its token
    is back (the first stage gets it from the last over the device link)."""
    kv = KVCacheManager(64, 4, 8)  # rows for two disjoint batches of up to 3
    sched = Scheduler(kv, FCFS(), Budget(3, 64), 512, {EOS}, allow_continuation=True, stride=2)
    runner = FakeRunner(4)
    outs, in_flight, gaps = {}, [], []
    prompts = {f"r{i}": [i + 3] * (2 + 3 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add(make_req(rid, prompt, max_tokens=4 + int(rid[1:])))
    index, flying = 0, {}  # request id -> indices of its steps in flight
    while sched.pool or in_flight:
        while len(in_flight) < 4 and (batch := sched.schedule()) is not None:
            for item in batch.scheduled:
                mine = flying.setdefault(item.request.request_id, [])
                gaps += [index - i for i in mine]
                mine.append(index)
            in_flight.append((index, batch, runner.execute(batch.step)))
            index += 1
        done, batch, sampled = in_flight.pop(0)
        for item in batch.scheduled:
            flying[item.request.request_id].remove(done)
        for out in sched.process(batch, sampled):
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, prompt in prompts.items():
        assert outs[rid] == expected_output(prompt, 4 + int(rid[1:]))
    assert gaps and min(gaps) == 2  # never in adjacent steps at once, continued at the stride
    assert any(-1 in s.token_ids for s in runner.steps)


def test_eos_while_the_next_step_is_in_flight_drops_its_token():
    sched, runner = make_scheduler(num_blocks=32), FakeRunner(4)
    sched.allow_continuation = True
    prompt = [5, 6, 7]
    first = expected_output(prompt, 1)[0]
    sched.eos_token_ids = {first}  # the very first sampled token is EOS
    sched.add(Request("e", prompt, SamplingParams(max_tokens=10), 0.0))
    b1 = sched.schedule()
    r1 = runner.execute(b1.step)
    b2 = sched.schedule()  # continues (token -1) before r1 is known
    assert b2 is not None and b2.step.token_ids == [-1]
    r2 = runner.execute(b2.step)
    outs = sched.process(b1, r1)
    assert outs[0].finish_reason == "stop" and outs[0].new_token_ids == [first]
    assert sched.process(b2, r2) == []  # the in-flight token of a finished request is dropped
    assert sched.kv.num_free_blocks == 32


def test_random_workload_fcfs_property_and_no_deadlock():
    rng = random.Random(1)
    sched, runner, outs = make_scheduler(num_blocks=40, block_size=4, max_batch=5,
                                         max_tokens=24), FakeRunner(4), {}
    expected, arrival = {}, []
    for step in range(400):
        if step < 200 and rng.random() < 0.4:
            rid = f"r{step}"
            prompt = [rng.randint(1, 190) for _ in range(rng.randint(1, 40))]
            n = rng.randint(1, 30)
            sched.add(make_req(rid, prompt, n, t=step))
            expected[rid] = expected_output(prompt, n)
            arrival.append(rid)
        run_step(sched, runner, outs)
        kv = sched.kv
        assert kv.num_free_blocks >= kv.num_reserved_blocks
        live = [sched.pool[r] for r in arrival if r in sched.pool]
        for earlier, later in zip(live, live[1:]):
            assert earlier.num_iterations >= later.num_iterations
    while sched.pool:
        assert run_step(sched, runner, outs) is not None, "deadlock: work left, none scheduled"
    for rid, toks in expected.items():
        assert outs[rid] == toks
    assert sched.kv.num_free_blocks == 40


def test_held_new_requests_wait_while_the_running_batch_drains():
    """FineInfer's deferral: a request that arrived at or after `hold_from` is not added
    to the batch; one that arrived before is, and so is a started one that was preempted."""
    sched, runner = make_scheduler(), FakeRunner(4)
    sched.add(make_req("old", [1, 2, 3], max_tokens=3, t=1.0))
    sched.add(make_req("new", [4, 5, 6], max_tokens=3, t=2.0))
    batch = sched.schedule(hold_from=2.0)
    assert [s.request.request_id for s in batch.scheduled] == ["old"]
    sched.process(batch, runner.execute(batch.step))
    assert sched.num_waiting == 1
    sched._preempt(sched.pool["old"])  # started: never held again
    batch = sched.schedule(hold_from=0.5)
    assert [s.request.request_id for s in batch.scheduled] == ["old"]
    batch2 = sched.schedule()  # nothing held: the new request joins
    assert "new" in [s.request.request_id for s in batch2.scheduled]
