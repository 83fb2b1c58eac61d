"""Fine-tuning while requests run (finetune_busy_share, engine_actors/finetune_busy.py),
through the engine loop with stand-in workers: training pieces run between the steps of
running requests and take about the configured share of the device's time; without a
share none runs beside them (FineInfer's rule only); a job is started, trained and ended in
pieces; a piece that raises fails its job only."""
from __future__ import annotations

import asyncio

import pytest
import ray

from engine_actors.config import EngineConfig
from tests.test_deferral import Workers, engine, queue_job, request, until

ITERATION_S = 0.01  # the stand-in workers' step (tests/test_deferral.py: 0.02)
PIECE_S = 0.01
PIECES = 3  # a micro-batch's pieces


class PieceWorkers(Workers):
    """Steps of ITERATION_S and training pieces of PIECE_S, one at a time on the device;
    every call logged with the time it ended."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.left = 0  # pieces left of the micro-batch in pieces
        self.ended = []  # (what, monotonic time)
        self.trained = 0
        self.lent_units = []  # what each micro-batch was lent
        self.pieces = PIECES  # a micro-batch's
        self.stop = 0  # runs of pieces up to this number stop (stop_training)
        self.num_micro = 0  # micro-batches begun
        self.on_piece = None  # called with (micro-batches begun, pieces run of the latest)

    async def execute(self, step):
        async with self.device:
            await asyncio.sleep(ITERATION_S)
            self.ended.append(("step", asyncio.get_running_loop().time()))
        return self.runner.execute(step)

    def stop_training(self, run):
        self.stop = max(self.stop, run)

    async def finetune(self, method, job_id, *args):
        if method != "piece":
            if method == "save":
                self.log.append((method, job_id))
                return None
            return await super().finetune(method, job_id, *args)
        run, count, *batch = args
        ran = 0
        async with self.device:  # the calls in order, as on the worker
            if batch:  # a new micro-batch: KV units lent, sequences, masks, trained tokens, last
                self.left, self.tokens = self.pieces, sum(map(len, batch[1]))
                self.lent_units.append(batch[0])
                self.num_micro += 1
            while self.left and ran < count and not (count > 1 and self.stop >= run):
                await asyncio.sleep(PIECE_S)
                self.ended.append(("piece", asyncio.get_running_loop().time()))
                self.log.append(("piece", job_id))
                self.left -= 1
                ran += 1
                if self.on_piece is not None:
                    self.on_piece(self.num_micro, self.pieces - self.left)
            out = {"done": not self.left, "left": self.left, "ran": ran, "gpu_s": ran * PIECE_S}
            if not self.left:
                self.trained += self.tokens
                out.update(loss_sum=1.0, loss_tokens=self.tokens, tokens=self.tokens,
                           peak_bytes=None, free_bytes=None)
        return out


def busy_engine(share: float, workers: PieceWorkers, epochs: int = 100):
    loop, finished = engine(1000.0, workers)
    cfg = EngineConfig(enable_finetuning=True, finetune_busy_share=share, block_size=4,
                       max_num_tokens=256, max_batch_size=8)
    from engine_actors.finetune_jobs import FineTuning
    loop.finetuning = FineTuning(cfg, adapters=type(
        "Adapters", (), {"load": lambda self, name, path: asyncio.sleep(0)})())
    queue_job(loop, "ftjob-1", 4, n_epochs=epochs)
    return loop, finished


async def serve_one(loop, finished, tokens: int) -> None:
    task = asyncio.create_task(loop.run())
    try:
        loop.add(request("a", tokens), None, None)
        await until(lambda: "a" in finished)
    finally:
        task.cancel()


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_training_takes_its_share_of_the_time_while_a_request_runs(share):
    workers = PieceWorkers(4)
    loop, finished = busy_engine(share, workers)
    asyncio.run(serve_one(loop, finished, 80))
    steps = [t for what, t in workers.ended if what == "step"]
    pieces = [t for what, t in workers.ended if what == "piece" and steps[0] < t < steps[-1]]
    if not share:
        assert not pieces and ("piece", "ftjob-1") not in workers.log
        log = workers.log  # the job starts once the request is done (FineInfer's rule)
        assert log.index(("finished", "a")) < log.index(("start", "ftjob-1"))
        return
    job = loop.finetuning.jobs["ftjob-1"]
    assert job.status == "running" and job.trained_tokens > 0  # micro-batches ended
    # the device's time while the request ran: pieces take about the share of it
    taken = len(pieces) * PIECE_S / (len(pieces) * PIECE_S + len(steps) * ITERATION_S)
    assert 0.15 < taken < 0.35, (taken, len(pieces), len(steps))
    # the engine's own count of that device time (health's busy_piece_s)
    stats = loop.finetuning.stats()["finetuning"]
    every = sum(what == "piece" for what, _ in workers.ended)
    assert stats["busy_piece_s"] >= len(pieces) * PIECE_S - 1e-6
    assert stats["busy_piece_s"] + stats["gap_piece_s"] == pytest.approx(every * PIECE_S)
    # never more than one piece between two steps: a step waits for one piece at most
    kinds = [what for what, _ in workers.ended]
    assert "piece,piece" not in ",".join(kinds[kinds.index("step"):len(kinds) - kinds[::-1].index("step")])


def test_a_job_trains_and_ends_in_pieces_while_requests_run():
    """A short job (4 examples, batch 2, one epoch: two optimizer steps) starts, trains
    and succeeds while one long request runs; its adapter is saved and it is dropped."""
    workers = PieceWorkers(4)
    loop, finished = busy_engine(0.5, workers, epochs=1)
    job = loop.finetuning.jobs["ftjob-1"]

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            loop.add(request("a", 200), None, None)
            await until(lambda: job.status == "succeeded")
            assert "a" not in finished  # all of it while the request ran
            await until(lambda: "a" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    assert job.steps_done == job.total_steps == 2 and job.trained_tokens == 80
    log = [e for e in workers.log if e[0] not in ("step", "finished")]
    assert log[0] == ("start", "ftjob-1") and ("micro_step", "ftjob-1") not in log
    assert log[-2:] == [("save", "ftjob-1"), ("drop", "ftjob-1")]


def test_a_piece_that_raises_fails_its_job_and_the_request_is_served():
    workers = PieceWorkers(4)
    loop, finished = busy_engine(0.5, workers)
    original = workers.finetune

    async def raises(method, job_id, *args):
        if method == "piece" and len(args) == 2:  # the second call of the first micro-batch
            raise ray.exceptions.RayTaskError(
                "finetune", "Traceback ...", RuntimeError("CUDA out of memory."))
        return await original(method, job_id, *args)

    workers.finetune = raises
    asyncio.run(serve_one(loop, finished, 60))
    job = loop.finetuning.jobs["ftjob-1"]
    assert job.status == "failed" and job.error["message"] == "RuntimeError: CUDA out of memory."
    assert ("drop", "ftjob-1") in workers.log and "a" in finished


def test_no_piece_while_requests_wait_to_be_admitted():
    """At capacity (one request at a time here), the second request waits for the first
    to finish: no piece runs while it waits (the engine's capacity is not given to
    training), and pieces run again beside it once it runs."""
    from engine_actors.policies import Budget

    workers = PieceWorkers(4)
    loop, finished = busy_engine(0.5, workers)
    loop.scheduler.budget = Budget(1, 256)
    marks = {}

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            loop.add(request("a", 40), None, None)
            await until(lambda: loop.scheduler.num_running == 1)
            loop.add(request("b", 40), None, None)
            marks["b added"] = asyncio.get_running_loop().time()
            await until(lambda: "a" in finished)
            marks["a done"] = asyncio.get_running_loop().time()
            await until(lambda: "b" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    pieces = [t for what, t in workers.ended if what == "piece"]
    # at most the piece in flight when b came ends while b waits
    waited = [t for t in pieces if marks["b added"] < t <= marks["a done"]]
    assert len(waited) <= 1, (len(waited), len(pieces))
    assert any(t > marks["a done"] for t in pieces)  # beside b, which then runs alone


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_micro_batches_longer_than_the_bound_run_in_pieces_between_requests(share):
    """A whole micro-batch would take longer than the deferral bound (5 ms here), so none
    runs whole, however long no request comes: between requests, one call runs a micro-
    batch's pieces back to back, and a request that comes stops it after the current
    piece. Without a share, none runs beside requests."""
    workers = PieceWorkers(4)
    workers.pieces = 8
    loop, finished = busy_engine(share, workers)
    # measured, as it were, over the bound (whose pieces' time stays over it too)
    loop.finetuning.step_s, loop.finetuning.bound_s = 5.0, 0.005
    original, calls = workers.finetune, []

    async def logged(method, job_id, *args):
        if method == "piece":
            calls.append(args[1])  # how many pieces it may run
        return await original(method, job_id, *args)

    workers.finetune = logged
    job, marks = loop.finetuning.jobs["ftjob-1"], {}

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            loop.add(request("a", 10), None, None)
            await until(lambda: "a" in finished)
            marks["a done"] = asyncio.get_running_loop().time()
            before = loop.finetuning.stats()["finetuning"]
            await asyncio.sleep(30 * PIECE_S * workers.pieces)
            assert loop.scheduler.num_running == 0
            after = loop.finetuning.stats()["finetuning"]  # counted apart from those beside a
            # (but the one sent while a ran, which may end after it)
            assert after["busy_piece_s"] - before["busy_piece_s"] <= PIECE_S + 1e-6
            assert after["gap_piece_s"] - before["gap_piece_s"] >= 10 * workers.pieces * PIECE_S
            assert after["in_pieces"]
            loop.add(request("b", 10), None, None)
            marks["b added"] = asyncio.get_running_loop().time()
            await until(lambda: "b" in finished)
        finally:
            task.cancel()

    asyncio.run(run())
    assert not any(what == "micro_step" for what, _ in workers.log)
    pieces = [t for what, t in workers.ended if what == "piece"]
    gap = sum(t > marks["a done"] for t in pieces)
    assert sum(count > 1 for count in calls) <= gap / 4  # several pieces a call
    steps = [t for what, t in workers.ended if what == "step"]
    b_first = min(t for t in steps if t > marks["b added"])
    assert sum(marks["b added"] < t < b_first for t in pieces) <= 1
    # the engine's count of how long the run took to stop for b: its piece, ~PIECE_S
    waits = loop.finetuning.stats()["finetuning"]["stop_wait_ms"]
    assert waits["count"] >= 1 and waits["max"] < 1e3 * (b_first - marks["b added"]) + 5
    if not share:  # none beside a (whose first step came before the job started)
        assert not any(steps[0] < t < marks["a done"] for t in pieces)
    # what the workers trained was recorded (but a micro-batch answered after the end)
    assert 0 <= workers.trained - job.trained_tokens <= 40


def test_no_request_is_held_for_a_whole_micro_batch_while_one_is_in_pieces():
    """FineInfer's deferral holds new requests so the batch drains for a whole micro-batch;
    none can run while one is in pieces, so none is held then."""
    loop, _ = busy_engine(0.25, PieceWorkers(4))
    ft = loop.finetuning
    ft.step_s = 0.1  # within the bound (200 ms): requests may be held for it
    assert ft.hold_from(10.0, drain_s=0.0) == pytest.approx(10.0 - (0.2 - 0.1))
    ft.busy.job = ft.queue[0]  # a micro-batch in pieces under way
    assert ft.hold_from(10.0, drain_s=0.0) is None


def test_between_requests_micro_batches_that_fit_the_bound_run_whole():
    """No request runs but a step is still in flight (that of a request just aborted): a job
    whose whole micro-batches fit the bound does not start one in pieces then (a request
    it held could not stop it, and its time would count as a whole one's)."""
    workers = PieceWorkers(4)
    loop, finished = busy_engine(0.0, workers)
    ft = loop.finetuning
    ft.step_s = 0.05  # measured within the 1-s bound: micro-batches run whole
    job = ft.queue[0]

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: job.status == "running" and job.trained_tokens)
            loop.add(request("a", 200), None, None)
            await until(lambda: loop.scheduler.num_running == 1)
            await asyncio.sleep(0.05)
            loop.scheduler.abort("a")  # the client left; its next step is in flight
            trained = job.trained_tokens
            await until(lambda: job.trained_tokens > trained)
        finally:
            task.cancel()

    asyncio.run(run())
    assert not ft.in_pieces and ("piece", "ftjob-1") not in workers.log


def test_a_job_cancelled_in_pieces_while_requests_run_holds_nothing_back():
    """A micro-batch was in pieces when its job was cancelled, and requests keep running:
    no micro-batch counts as in pieces any more (which would keep FineInfer's deferral and
    whole micro-batches off for the next job until the requests are gone)."""
    workers = PieceWorkers(4)
    workers.pieces = 50
    loop, finished = busy_engine(0.0, workers)
    ft = loop.finetuning
    ft.step_s = 5.0  # over the 1-s bound: in pieces between requests
    job = ft.queue[0]

    async def run():
        task = asyncio.create_task(loop.run())
        try:
            await until(lambda: ft.busy.job is job)  # a micro-batch in pieces
            loop.add(request("a", 200), None, None)  # stops the run; a runs from now
            await until(lambda: loop.scheduler.num_running == 1 and ft.busy.call is None)
            await ft.cancel(job.id, workers)
            await asyncio.sleep(0.1)  # a's steps go on
            assert loop.scheduler.num_running == 1
            return ft.busy.active
        finally:
            task.cancel()

    assert asyncio.run(run()) is False
    assert job.status == "cancelled"
