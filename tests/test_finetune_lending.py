"""Micro-batches in pieces borrow KV blocks between requests (engine_actors/finetune_busy.py),
through the engine loop with stand-in workers: requests run beside a paused micro-batch on
the other blocks; one that needs the lent blocks has the micro-batch called off (its
examples run later) and gets them back before its first step."""
from __future__ import annotations

import asyncio

import pytest

from engine_actors.config import EngineConfig
from engine_actors.finetune_busy import needs_lent_blocks
from engine_actors.request import Request
from engine_actors.scheduler import Scheduler
from tests.test_deferral import request, until
from tests.test_finetune_busy import PieceWorkers, busy_engine

MEMORY = {"free_bytes": 0, "lend_unit_blocks": 8, "lendable_units": 8, "lend_unit_bytes": 1000,
          "bytes_per_token_guess": 40.0}  # nothing free beside the pool: an example needs a unit


def lending_engine(pieces: int, epochs: int):
    """An engine whose job trains in pieces (measured, as it were, over the bound) with
    nothing free beside the pool, so every micro-batch borrows; and the (request, KV blocks
    lent) of each request's first step."""
    workers = PieceWorkers(4)
    workers.pieces = pieces
    loop, finished = busy_engine(0.0, workers, epochs=epochs)  # micro-batches of one example
    loop.finetuning.step_s, loop.finetuning.bound_s = 5.0, 0.005
    original_finetune, original_execute = workers.finetune, workers.execute
    first_steps = []

    async def finetune(method, job_id, *args):
        out = await original_finetune(method, job_id, *args)
        if method == "start":
            return dict(MEMORY)
        if method == "piece" and out["done"]:
            out["free_bytes"] = 0
        return out

    async def execute(step):
        rows = {r.row: r.request_id for r in loop.scheduler.admitted.values()}
        first_steps.extend((rows[r.row], loop.scheduler.kv.num_lent_blocks)
                           for r in step.new_requests)
        return await original_execute(step)

    workers.finetune, workers.execute = finetune, execute
    return workers, loop, finished, first_steps


def test_pieces_borrow_kv_blocks_and_give_them_back_when_requests_need_them():
    workers, loop, finished, first_steps = lending_engine(8, epochs=3)  # 12 micro-batches
    kv, job = loop.scheduler.kv, loop.finetuning.jobs["ftjob-1"]
    plan = {1: "small", 3: "big"}  # a request comes at the third piece of these micro-batches

    def on_piece(micro, piece):
        rid = plan.get(micro) if piece == 3 else None
        if rid is not None and rid not in loop.scheduler.pool and rid not in finished:
            # small: 18 tokens; big: reserves 228 tokens, 57 blocks, of 56 not lent
            loop.add(request(rid, 10 if rid == "small" else 220), None, None)

    workers.on_piece = on_piece

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: "small" in finished)
            assert kv.num_lent_blocks == 8  # still held by the paused micro-batch
            await until(lambda: "big" in finished and job.status == "succeeded")
            await until(lambda: kv.num_lent_blocks == 0)  # the job is over: all given back
        finally:
            task.cancel()

    asyncio.run(run())
    assert first_steps == [("small", 8), ("big", 0)]
    log = [what for what, _ in workers.log if what in ("call_off", "take_back")]
    assert log[:2] == ["call_off", "take_back"]  # once, for big; none for small
    assert sum(units > 0 for units in workers.lent_units) >= 12  # every micro-batch borrowed
    # every example trained once an epoch, the called-off micro-batch's again later
    assert job.trained_tokens == 3 * 4 * 20 == workers.trained
    assert loop.finetuning.busy.num_called_off == 1


def test_an_example_larger_than_the_whole_pool_fails_its_job_in_pieces():
    """Between requests a micro-batch in pieces may have every lendable block; an example
    that needs more fails its job (named sizes), and serving goes on."""
    workers = PieceWorkers(4)
    loop, finished = busy_engine(0.0, workers)
    loop.finetuning.step_s, loop.finetuning.bound_s = 5.0, 0.005  # in pieces
    job, original = loop.finetuning.jobs["ftjob-1"], workers.finetune

    async def finetune(method, job_id, *args):
        out = await original(method, job_id, *args)
        # 20-token examples need 1,000 bytes: 8 units of 10 bytes are far from enough
        return {**MEMORY, "lend_unit_bytes": 10} if method == "start" else out

    workers.finetune = finetune

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: job.status == "failed")
            loop.add(request("a", 5), None, None)
            await until(lambda: "a" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    assert "a training example of 20 tokens needs" in job.error["message"]
    assert ("drop", "ftjob-1") in workers.log and not workers.lent_units


def test_lent_blocks_stay_lent_for_a_request_between_micro_batches_that_needs_none():
    """A request that arrives as a micro-batch in pieces ends (none holds the lent blocks
    then) runs with them still lent when it does not need them: no take-back holds up its
    first step, and the next micro-batch reuses them."""
    workers, loop, finished, first_steps = lending_engine(4, epochs=2)  # 8 micro-batches
    kv, job = loop.scheduler.kv, loop.finetuning.jobs["ftjob-1"]

    def on_piece(micro, piece):  # during the last piece of the second micro-batch
        if micro == 2 and piece == workers.pieces and "late" not in loop.scheduler.pool:
            loop.add(request("late", 10), None, None)

    workers.on_piece = on_piece

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: "late" in finished and job.status == "succeeded")
            await until(lambda: kv.num_lent_blocks == 0)
        finally:
            task.cancel()

    asyncio.run(run())
    assert first_steps == [("late", 8)]
    log = [what for what, _ in workers.log if what in ("call_off", "take_back")]
    assert log == ["take_back"]  # once, when the job was over
    assert workers.lent_units == [1] + [1] * 7  # lent once, then reused


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_that_grow_past_their_reservation_need_the_lent_blocks(policy):
    """FCFS reserves a request's prompt and max_tokens, so it never takes more; a policy
    that reserves nothing lets running requests grow, and the lent blocks are needed once
    fewer are unreserved than two steps of theirs could take (no running request is
    preempted for training's memory)."""
    cfg = EngineConfig(scheduling_policy=policy, block_size=4, max_num_batched_tokens=128)
    scheduler = Scheduler.from_config(cfg, 64, 512, (0,))
    engine_request = request("a", 20)
    scheduler.add(Request("a", engine_request.prompt_token_ids, engine_request.sampling, 0.0,
                          None))
    assert scheduler.schedule(None) is not None  # admitted: its prompt's 2 blocks
    kv = scheduler.kv
    assert kv.lend(1, 8, 8) == 1 and kv.num_lent_blocks == 8
    # fcfs: 64 - 8 lent - 7 held or reserved; priority: 64 - 8 - 2, fewer than the 66 blocks
    # two steps of one growing request could take (1 each, and 32 for a budget of tokens)
    assert kv.num_unreserved_blocks == (49 if policy == "fcfs" else 54)
    assert needs_lent_blocks(scheduler) == (policy == "priority")


@pytest.mark.parametrize("second_tokens,needed", [(20, False), (180, True)])
def test_any_waiting_request_a_step_could_admit_may_need_the_lent_blocks(second_tokens,
                                                                        needed):
    """Not only the first waiting request: one behind it (which the policy may reach
    first, the first skipped for its adapter) that fits only with the lent blocks needs
    them; two that fit beside them do not."""
    scheduler = Scheduler.from_config(EngineConfig(block_size=4), 64, 512, (0,))
    for rid, tokens in (("first", 20), ("second", second_tokens)):
        r = request(rid, tokens)
        scheduler.add(Request(rid, r.prompt_token_ids, r.sampling, 0.0, None))
    kv = scheduler.kv
    assert kv.lend(2, 8, 8) == 2 and kv.num_unreserved_blocks == 48
    # first: 8 + 20 tokens, 7 blocks; second: 7 or 47 (8 + 180 tokens)
    assert needs_lent_blocks(scheduler) == needed
