"""Fine-tuning's pipeline through the engine loop, with test_deferral.py's stand-in workers:
in a lull the next micro-batch waits on the workers; a request that comes calls it off, so
it waits for one step at most; a cancelled job's micro-batch sent ahead is called off."""
from __future__ import annotations

import asyncio
import time

from tests.test_deferral import ITERATION_S, STEP_S, Workers, engine, request, until


def test_with_no_request_near_the_next_micro_batch_waits_on_the_workers(monkeypatch):
    """After QUIET_S without arrivals, a micro-batch is sent while the one before it runs
    (the call's time hidden); a request that comes then calls off the one sent ahead, so it
    waits for one step at most, and its examples run later."""
    monkeypatch.setattr("engine_actors.finetune_jobs.QUIET_S", 0.3)
    # whole micro-batches only: a step measured past the bound (50 ms of sleep on a busy
    # machine) would turn them to pieces, which the stand-in workers do not run
    monkeypatch.setattr("engine_actors.finetune_jobs.FineTuning.in_pieces", False)
    workers = Workers(4)
    # a 60-ms bound: a request that waited through a step may not wait for another
    loop, finished = engine(60.0, workers)
    job = loop.finetuning.queue[0]

    async def run():
        loop.last_arrival = start = time.monotonic()  # as if a request just came
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: workers.training_calls
                        and workers.training_calls[-1][0] > start + 0.6)
            loop.add(request("a", 3), None, None)
            arrived = time.monotonic()
            workers.log.append(("arrived", "a"))
            await until(lambda: "a" in finished)
            served = time.monotonic()
        finally:
            task.cancel()
        return start, arrived, served

    start, arrived, served = asyncio.run(run())
    calls = workers.training_calls
    assert all(n == 1 for t, n in calls if t < start + 0.25)  # not quiet yet: one at a time
    assert any(n == 2 for t, n in calls if start + 0.35 < t < arrived)  # quiet: two
    log = workers.log[workers.log.index(("arrived", "a")):workers.log.index(("finished", "a"))]
    assert ("micro_step", "ftjob-1") not in log  # nothing more was sent before a ran
    assert ("skipped", "ftjob-1") in log  # the one sent ahead did not run
    assert served - arrived < STEP_S + 5 * ITERATION_S
    assert job.status == "running" and job.steps_done > 0


def test_a_job_cancelled_with_a_micro_batch_sent_ahead_ends_cleanly(monkeypatch):
    monkeypatch.setattr("engine_actors.finetune_jobs.QUIET_S", 0.0)
    workers = Workers(4)
    loop, finished = engine(200.0, workers)
    ft = loop.finetuning

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: ft.ahead is not None)
            await ft.cancel("ftjob-1", workers)
            await until(lambda: ft.ahead is None)
            loop.add(request("a", 3), None, None)  # serving goes on
            await until(lambda: "a" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    assert ft.jobs["ftjob-1"].status == "cancelled" and not ft.queue
    # the micro-batch sent ahead was called off, before the trainer was dropped
    assert workers.log.index(("skipped", "ftjob-1")) < workers.log.index(("drop", "ftjob-1"))
    assert workers.log.count(("skipped", "ftjob-1")) == 1


def test_a_request_that_comes_while_a_job_starts_keeps_the_pipeline_off(monkeypatch):
    """Whether to send a micro-batch ahead is decided once the first is sent, not before the
    trainer's start: a request that came meanwhile waits for one step at most."""
    monkeypatch.setattr("engine_actors.finetune_jobs.QUIET_S", 0.0)
    workers = Workers(4)
    workers.start_s = 0.1
    loop, finished = engine(60.0, workers)

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: ("start", "ftjob-1") in workers.log)
            loop.add(request("a", 3), None, None)
            await until(lambda: "a" in finished)
        finally:
            task.cancel()
        return list(workers.training_calls)

    calls = asyncio.run(run())
    assert calls and calls[0][1] == 1 and not any(n == 2 for _, n in calls[:2])
    assert workers.log.index(("finished", "a")) < workers.log.index(("micro_step", "ftjob-1")) + 4


def test_no_micro_batch_is_sent_ahead_of_one_called_off(monkeypatch):
    """A request came and went (aborted at once) while a micro-batch waited on the workers:
    it is called off, and nothing is sent ahead before its examples are next again, so
    they run next, in their batch (not after the micro-batches behind them)."""
    monkeypatch.setattr("engine_actors.finetune_jobs.QUIET_S", 0.0)
    workers = Workers(4)
    loop, finished = engine(200.0, workers)
    ft = loop.finetuning
    sends = []
    send = ft._send
    monkeypatch.setattr(ft, "_send", lambda *a, **k: sends.append(send(*a, **k)) or sends[-1])

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: ft.ahead is not None and len(sends) >= 3)
            ahead = ft.ahead
            loop.add(request("a", 3), None, None)  # calls it off...
            loop.scheduler.abort("a")  # ...and is gone before the next iteration
            await until(lambda: sends.index(ahead) + 2 < len(sends))
        finally:
            task.cancel()
        return ahead

    ahead = asyncio.run(run())
    assert ("skipped", "ftjob-1") in workers.log
    after = sends[sends.index(ahead) + 1:]
    assert after[0].micro == ahead.micro, (ahead.micro, [s.micro for s in after])
