"""FineInfer's deferred continuous batching through the engine loop, with stand-in workers:
new requests are held out of a draining batch so that a fine-tuning step runs when it is
empty, only while the batch can drain within the deferral bound; and lent KV blocks that
cannot be mapped back fail the job, not serving."""
from __future__ import annotations

import asyncio
import time

import ray

from engine_actors.checkpoint import ModelInfo
from engine_actors.config import EngineConfig
from engine_actors.engine_loop import EngineLoop
from engine_actors.finetune_job import Job
from engine_actors.finetune_jobs import FineTuning
from engine_actors.metrics import EngineMetrics
from engine_actors.request import SamplingParams
from engine_actors.messages import EngineRequest
from engine_actors.scheduler import Scheduler
from tests.fake_runner import FakeRunner

ITERATION_S = 0.02
STEP_S = 0.05


class Workers:
    """The executor's interface: steps take ITERATION_S, fine-tuning steps STEP_S; every
    call is logged in order."""

    def __init__(self, block_size: int, take_back_failures: int = 0):
        self.runner, self.log = FakeRunner(block_size), []
        self.take_back_failures = take_back_failures
        self.device = asyncio.Lock()  # steps run one after the other, as on a GPU
        self.training_calls = []  # (when, micro-steps sent and not answered, with this one)
        self.unanswered = 0
        self.skip = set()  # micro-steps called off
        self.start_s = 0.0  # how long a trainer takes to start

    def skip_training(self, seq):
        self.skip.add(seq)

    async def execute(self, step):
        async with self.device:
            await asyncio.sleep(ITERATION_S)
        by_row = {r.row: r.request_id for r in self.scheduler.admitted.values()}
        self.log += [("step", by_row[r.row]) for r in step.new_requests]  # a request's first
        return self.runner.execute(step)

    async def finetune(self, method, job_id, *args):
        if method == "drop":  # logged when it runs, in order with the training steps
            async with self.device:
                self.log.append((method, job_id))
            return None
        self.log.append((method, job_id))
        if method == "start":
            await asyncio.sleep(self.start_s)
        if method == "take_back" and self.take_back_failures:
            self.take_back_failures -= 1
            raise ray.exceptions.RayError("cuMemCreate failed with error 2")
        if method == "micro_step":  # args: seq, after, units, sequences, masks, ...
            self.unanswered += 1
            self.training_calls.append((time.monotonic(), self.unanswered))
            try:
                async with self.device:
                    if args[0] in self.skip:
                        self.log.append(("skipped", job_id))
                        return {"skipped": True, "free_bytes": None}
                    await asyncio.sleep(STEP_S)
            finally:
                self.unanswered -= 1
            return {"loss_sum": 1.0, "tokens": sum(map(len, args[3])), "peak_bytes": None,
                    "elapsed_s": STEP_S,
                    "free_bytes": None}
        if method == "start":
            return {"free_bytes": None, "lend_unit_blocks": 8, "lendable_units": 8,
                    "lend_unit_bytes": 0, "bytes_per_token_guess": 1.0}
        return None


def engine(bound_ms: float, workers: Workers) -> tuple[EngineLoop, list]:
    cfg = EngineConfig(enable_finetuning=True, finetune_deferral_ms=bound_ms, block_size=4,
                       max_num_tokens=256, max_batch_size=8)
    scheduler = Scheduler.from_config(cfg, 64, 512, (0,))
    info = ModelInfo("m", "", 512, (0,), 256)
    finished = []

    def deliver(outputs, error):
        finished.extend(o.request_id for o in outputs if o.finish_reason is not None)
        for o in outputs:
            if o.finish_reason is not None:
                workers.log.append(("finished", o.request_id))

    loop = EngineLoop(cfg, info, workers, scheduler, EngineMetrics("m"), deliver)
    workers.scheduler = scheduler
    loop.finetuning = FineTuning(cfg, adapters=None)
    queue_job(loop, "ftjob-1", 64, n_epochs=100)
    return loop, finished


def queue_job(loop: EngineLoop, job_id: str, num_examples: int, n_epochs: int = 1) -> Job:
    """A job of `num_examples` 20-token examples behind those queued."""
    job = Job(job_id, "m", "f", [([1] * 20, [True] * 20)] * num_examples, n_epochs=n_epochs,
              batch_size=2, learning_rate=1e-3, lora={"r": 8, "alpha": 16, "target_modules": []},
              suffix=None, seed=0)
    loop.finetuning.jobs[job.id] = job
    loop.finetuning.queue.append(job)
    return job


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait for condition() (a regression fails the test instead of hanging it)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def request(rid: str, tokens: int) -> EngineRequest:
    return EngineRequest(rid, list(range(1, 9)), SamplingParams(max_tokens=tokens,
                                                                temperature=0.0, ignore_eos=True))


async def _scenario(bound_ms: float, workers: Workers) -> list:
    loop, finished = engine(bound_ms, workers)
    task = asyncio.create_task(loop.run())
    try:
        loop.add(request("a", 20), None, None)  # no step time measured yet: a runs
        await until(lambda: ("step", "a") in workers.log)
        loop.finetuning.step_s = STEP_S  # as if measured now
        await asyncio.sleep(3 * ITERATION_S)
        loop.add(request("b", 2), None, None)
        await until(lambda: "b" in finished)
    finally:
        task.cancel()
    return workers.log


def test_a_new_request_is_held_while_the_batch_drains_then_a_step_runs_first():
    # a's ~16 iterations left (~0.3 s) plus a step (0.05 s) fit in the 1-s bound: b waits
    log = asyncio.run(_scenario(1000.0, Workers(4)))
    events = [e for e in log if e[0] in ("step", "micro_step", "finished")]
    a_end, b_start = events.index(("finished", "a")), events.index(("step", "b"))
    assert a_end < b_start
    assert ("micro_step", "ftjob-1") in events[a_end:b_start]


def test_nothing_is_held_when_the_batch_cannot_drain_within_the_bound():
    # the same load with a 250-ms bound: a step would fit, a's drain would not; b joins
    log = asyncio.run(_scenario(250.0, Workers(4)))
    b_start = log.index(("step", "b"))
    assert ("finished", "a") not in log[:b_start]
    assert ("micro_step", "ftjob-1") not in log[log.index(("step", "a")):b_start]


def test_lent_blocks_that_cannot_come_back_fail_the_job_and_serving_goes_on():
    workers = Workers(4, take_back_failures=1)
    loop, finished = engine(1000.0, workers)
    # as after a training step; more than half the pool, so requests need the blocks back
    loop.scheduler.kv.lend(5, 8, 8)
    job = loop.finetuning.jobs["ftjob-1"]
    job.started, job.status = True, "running"
    loop.finetuning.retry_at = time.monotonic() + 100  # no further step: serving resumes

    async def run():
        task = asyncio.create_task(loop.run())
        loop.add(request("a", 3), None, None)
        try:
            await until(lambda: "a" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    assert workers.log[:3] == [("take_back", ""), ("drop", "ftjob-1"), ("take_back", "")]
    assert job.status == "failed" and "could not be returned" in job.error["message"]
    assert loop.scheduler.kv.num_lent_blocks == 0


def test_a_worker_lost_in_a_training_step_fails_that_job_and_restarts_the_workers():
    workers = Workers(4)
    loop, finished = engine(1000.0, workers)
    second = queue_job(loop, "ftjob-2", 4)
    restarts = []

    async def restart():  # what has happened when the workers are replaced
        restarts.append((loop.finetuning.queue[0].id, ("start", "ftjob-2") in workers.log))

    loop._restart_workers = restart
    original = workers.finetune

    async def dies_once(method, job_id, *args):
        if method == "micro_step" and job_id == "ftjob-1":
            raise ray.exceptions.RayActorError()
        return await original(method, job_id, *args)

    workers.finetune = dies_once

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: restarts)
        finally:
            task.cancel()

    asyncio.run(run())
    first = loop.finetuning.jobs["ftjob-1"]
    assert first.status == "failed" and "RayActorError" in first.error["message"]
    assert restarts == [("ftjob-2", False)]  # replaced before the next job started
    assert second.status != "failed"


def test_a_step_that_raises_fails_its_job_only_and_serving_goes_on():
    """An error inside a training step (out of memory, a bug) fails that job with the error
    and frees its trainer; the workers are not restarted, the next job trains, requests
    are served."""
    workers = Workers(4)
    loop, finished = engine(1000.0, workers)
    second = queue_job(loop, "ftjob-2", 2)
    restarts = []

    async def restart():
        restarts.append(True)

    loop._restart_workers = restart
    original = workers.finetune

    async def raises_once(method, job_id, *args):
        if method == "micro_step" and job_id == "ftjob-1":
            raise ray.exceptions.RayTaskError(
                "finetune", "Traceback ...", RuntimeError("CUDA out of memory. Tried to "
                                                          "allocate 2.00 GiB"))
        if method == "save":
            return None
        return await original(method, job_id, *args)

    workers.finetune = raises_once
    loop.finetuning.adapters = type("Adapters", (), {"load": lambda self, name, path: asyncio.sleep(0)})()

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: second.status == "succeeded")
            loop.add(request("a", 3), None, None)
            await until(lambda: "a" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    first = loop.finetuning.jobs["ftjob-1"]
    assert first.status == "failed"
    assert first.error["message"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert not restarts
    assert workers.log.index(("drop", "ftjob-1")) < workers.log.index(("start", "ftjob-2"))


def test_replaced_workers_fail_the_running_job_with_the_reason():
    loop, _ = engine(1000.0, Workers(4))
    job = loop.finetuning.queue[0]
    job.started, job.status = True, "running"
    loop.finetuning.workers_replaced()
    assert job.status == "failed" and "restarted" in job.error["message"]
    assert not loop.finetuning.queue


def test_a_job_cancelled_while_its_adapter_is_saved_stays_cancelled():
    workers = Workers(4)
    loop, _ = engine(1000.0, workers)
    ft = loop.finetuning
    job = ft.queue[0]
    job.started, job.status = True, "running"
    original = workers.finetune

    async def slow_save(method, job_id, *args):
        if method == "save":
            await ft.cancel(job_id, workers)  # the user cancels meanwhile
        return await original(method, job_id, *args)

    workers.finetune = slow_save
    asyncio.run(ft._finish(job, workers))
    assert job.status == "cancelled" and job.fine_tuned_model is None


def test_a_job_cancelled_while_lent_blocks_come_back_before_its_start_never_starts():
    """Before a job's trainer is created, blocks an earlier job borrowed are mapped back; a
    cancel that lands meanwhile ends it: it never starts, and serving goes on."""
    workers = Workers(4)
    loop, finished = engine(1000.0, workers)
    ft = loop.finetuning
    job = ft.queue[0]
    loop.scheduler.kv.lend(1, 8, 8)  # still lent after the earlier job's last micro-batch
    original = workers.finetune

    async def cancel_meanwhile(method, job_id, *args):
        if method == "take_back":
            await ft.cancel(job.id, workers)
        return await original(method, job_id, *args)

    workers.finetune = cancel_meanwhile

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: ("take_back", "") in workers.log)
            loop.add(request("a", 3), None, None)
            await until(lambda: "a" in finished or task.done())
            assert not task.done()  # the engine loop did not fail
        finally:
            task.cancel()

    asyncio.run(run())
    assert job.status == "cancelled" and ("start", "ftjob-1") not in workers.log


class Generations(Workers):
    """Stand-in workers whose steps in flight fail once they are replaced."""
    generation = 0

    async def execute(self, step):
        generation = self.generation
        by_row = {r.row: r.request_id for r in self.scheduler.admitted.values()}
        async with self.device:
            await asyncio.sleep(ITERATION_S)
        if generation != self.generation:
            raise ray.exceptions.RayActorError()
        self.log += [("step", by_row[r.row]) for r in step.new_requests]
        return self.runner.execute(step)


def test_lent_blocks_that_cannot_come_back_while_steps_run_restart_the_workers_once():
    """Blocks kept lent beside running requests cannot be mapped back when a request needs
    them: the workers are replaced once (the steps in flight on the old ones are dropped
    with them), and a request that waited then runs on the new workers."""
    workers = Generations(4, take_back_failures=1)
    loop, finished = engine(1000.0, workers)
    errors = {}
    deliver = loop.deliver

    def record(outputs, error):
        errors.update((o.request_id, error) for o in outputs if o.finish_reason is not None)
        deliver(outputs, error)

    loop.deliver = record
    loop.scheduler.kv.lend(1, 8, 8)  # kept lent for the job's next micro-batch
    job = loop.finetuning.jobs["ftjob-1"]
    job.started, job.status = True, "running"
    loop.finetuning.retry_at = time.monotonic() + 100  # no further training step
    restarts = []

    async def restart():
        restarts.append(True)
        workers.generation += 1
        loop.finetuning.workers_replaced()

    loop._restart_workers = restart

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            loop.add(request("a", 100), None, None)  # fits beside the lent blocks
            await until(lambda: ("step", "a") in workers.log)
            loop.finetuning._end(job, "succeeded")  # nothing keeps them lent now...
            job.started = False
            loop.add(request("b", 120), None, None)  # ...and b needs them
            await until(lambda: "b" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    assert len(restarts) == 1
    assert errors["a"] is not None and errors["b"] is None
