"""Fine-tuning steps on the workers, for the scheduler actor's jobs (finetune_jobs.py says
when they run): a job's trainer started, its micro-batches planned against the memory that
can be freed (finetune_memory.py) and sent, their results recorded, the memory lent by the
KV pool mapped back before inference runs again, and failures of any of these.

With no request near (the engine loop's `pipeline`), the next micro-batch is sent while
one runs, as inference keeps two steps in flight: the workers run calls in order, so the
call's and the planning's time are hidden and the device goes from one to the next. A
request that arrives calls the one sent ahead off (`skip_ahead`) if it has not started.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import ray

from engine_actors.finetune_job import Job
from engine_actors.finetune_memory import plan_micro_batch

logger = logging.getLogger("orca_serve.finetune")
MEMORY_RETRY_S = 0.1  # when no example fits in the memory free now, ask again this much later


@dataclasses.dataclass
class Sent:
    """A micro-batch sent to the workers, and what its result is recorded with."""
    job: Job
    call: asyncio.Future  # the workers' answer (executor.finetune)
    loss_tokens: int  # its batch's trained tokens
    last: bool  # it ends its batch: the optimizer steps
    sent_at: float
    seq: int  # its number, to call it off (`skip_ahead`)
    micro: list[int]  # its examples
    skip: bool = False  # called off, if it has not started


class TrainingSteps:
    """The steps of the queue's first job. The subclass (FineTuning) owns the queue and
    ends jobs: `_fail` and `_finish`."""

    def __init__(self, cfg, metrics=None):
        self.cfg, self.metrics = cfg, metrics
        self.queue: list[Job] = []  # queued and running, oldest first
        self.step_s: float | None = None  # measured time of one step, averaged
        self.train_s: float | None = None  # of which the trainer's, on the worker
        self.take_back_s: float | None = None  # mapping lent memory back, averaged
        self.num_take_backs = 0
        self.micro_tokens = 0.0  # tokens of a micro-batch, averaged
        self.memory: dict | None = None  # the worker's: free bytes, how the KV pool lends
        self.retry_at = 0.0  # no micro-batch fitted in memory: not before then
        self.ahead: Sent | None = None  # sent while the one before it ran (`pipeline`)
        self.busy = None  # BusyTraining: micro-batches in pieces (finetune_busy.py)
        self.num_sent = 0
        self.num_ahead = self.num_skipped = 0  # sent ahead; of which called off

    def plan(self, job: Job, kv) -> tuple[int, list[int]] | None:
        """The next micro-batch of `job` and the KV units lent for it (finetune_memory.py)."""
        return plan_micro_batch(job, kv, self.memory, self.cfg.finetune_max_tokens)

    async def step(self, executor, kv, pipeline=None) -> bool:
        """One micro-batch of the oldest job; its end (saved and served) after the last.
        `kv`: the scheduler's KV manager, which lends blocks for the step's memory.
        `pipeline()`, asked once this micro-batch is sent: no request is near, so the next
        one is sent while this one runs (the call's and the planning's time hidden); the
        next call takes its result. True: a worker is gone (the job failed), the workers
        must be replaced."""
        sent, self.ahead = self.ahead, None
        job = sent.job if sent else self.queue[0]
        start = time.monotonic()
        try:
            if sent is None:
                if not job.started:
                    started = await self._start(job, executor, kv)
                    if started is not None:
                        return started
                sent = self._send(job, kv, executor, after=-1)
                if sent is None:
                    self.retry_at = time.monotonic() + MEMORY_RETRY_S
                    return False
            # (not after one called off: its examples must be next again)
            if pipeline and not sent.skip and pipeline() and job.status == "running" \
                    and job.has_next():
                self.ahead = self._send(job, kv, executor, after=sent.seq)  # None: no memory
                self.num_ahead += self.ahead is not None
            out = await sent.call
        except (ray.exceptions.RayError, ValueError) as e:
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e
            message = str(cause) if isinstance(cause, ValueError) \
                else f"{type(cause).__name__}: {cause}"
            if job.status == "running":  # not cancelled meanwhile
                self._fail(job, message.splitlines()[0])
            await self._discard_ahead(executor, sent)
            if isinstance(e, ray.exceptions.RayActorError):  # a worker died: its memory too
                job.started = False
                return True
            await self._drop(job, executor)
            return False
        self.memory = {**self.memory, "free_bytes": out["free_bytes"],
                       "alloc_retries": out.get("alloc_retries", 0)}
        if out.get("skipped"):  # called off before it started: its examples are next again
            self.num_skipped += 1
            if job.status == "running":
                job.untake(sent.micro)
            return False
        self._measure(out, time.monotonic() - max(start, sent.sent_at))
        if job.status != "running":
            await self._discard_ahead(executor)
            return False  # cancelled while the step ran
        await self.record(job, out, sent.loss_tokens, sent.last, executor)
        return False

    async def record(self, job: Job, out: dict, loss_tokens: int, last: bool,
                     executor) -> None:
        """A running job's micro-batch is done (`out`: the worker's answer): its memory
        per token, loss and tokens; an event at the end of its batch; the job's end after
        its last step."""
        if out["peak_bytes"] is not None:
            job.measure_memory(out["peak_bytes"], out["tokens"])
        if self.metrics is not None:
            self.metrics.finetune_steps.inc()
            self.metrics.finetune_tokens.inc(out["tokens"])
        loss = job.record(out["tokens"], out["loss_sum"], loss_tokens, last)
        if loss is not None:
            job.event(f"Step {job.steps_done}/{job.total_steps}: training loss={loss:.4f}",
                      {"step": job.steps_done, "total_steps": job.total_steps,
                       "train_loss": loss, "trained_tokens": job.trained_tokens})
            if job.steps_done == job.total_steps:
                await self._finish(job, executor)

    def _measure(self, out: dict, elapsed: float) -> None:
        """A micro-batch's times (`elapsed`: since the one before it ended, or since it was
        sent) and size, averaged, and its metrics."""
        self.step_s = elapsed if self.step_s is None else 0.8 * self.step_s + 0.2 * elapsed
        # of which the trainer's own time on the worker (the rest: calls, planning, lending)
        self.train_s = out["elapsed_s"] if self.train_s is None \
            else 0.8 * self.train_s + 0.2 * out["elapsed_s"]
        self.micro_tokens = 0.8 * self.micro_tokens + 0.2 * out["tokens"]
        if self.metrics is not None:
            self.metrics.finetune_step_time.observe(elapsed)

    def measure_pieces(self, device_s: float, tokens: int) -> None:
        """A micro-batch of `tokens` run in pieces ended, their device time `device_s` in
        all: what a whole one would take, as far as it shows (it decides whether
        micro-batches run whole: FineTuning.in_pieces)."""
        self.step_s = device_s if self.step_s is None else 0.8 * self.step_s + 0.2 * device_s
        self.micro_tokens = 0.8 * self.micro_tokens + 0.2 * tokens

    async def _start(self, job: Job, executor, kv) -> bool | None:
        """Create the job's trainer on the workers. None: started; else it did not, and
        what `step` returns (True: a worker is gone; False: cancelled meanwhile)."""
        # a new trainer's state must not sit in memory lent by an earlier job
        if kv.num_lent_blocks and not await self.take_back(executor, kv):
            return True
        if job.status != "queued":  # cancelled while the blocks were mapped back
            return False
        return None if self.started(job, await self.start_call(job, executor)) else False

    def start_call(self, job: Job, executor):
        """The job is running from now: its trainer's creation on the workers, to await."""
        job.started, job.status = True, "running"
        lora = job.lora
        return executor.finetune("start", job.id, lora["r"], lora["alpha"],
                                 lora["target_modules"], job.learning_rate, job.seed)

    def started(self, job: Job, memory: dict) -> bool:
        """The trainer exists (`memory`: the workers' answer); False if the job was
        cancelled meanwhile (and dropped)."""
        self.memory = memory
        if job.status != "running":
            return False
        job.event("Fine-tuning job started")
        return True

    def _send(self, job: Job, kv, executor, after: int) -> Sent | None:
        """Plan the job's next micro-batch and send it to the workers, to run after
        micro-batch `after` (-1: none is outstanding); None when it does not fit in the
        memory that can be freed now."""
        planned = self.plan(job, kv)
        if planned is None:
            return None
        units, micro = planned
        loss_tokens, last = job.take_micro(micro)
        self.num_sent += 1
        call = asyncio.ensure_future(executor.finetune(
            "micro_step", job.id, self.num_sent, after, units,
            [job.examples[i][0] for i in micro], [job.examples[i][1] for i in micro],
            loss_tokens, last))
        return Sent(job, call, loss_tokens, last, time.monotonic(), self.num_sent, micro)

    def skip_ahead(self, executor) -> None:
        """A request came: the micro-batch sent ahead is called off if it has not started,
        so the request waits for one step at most, as without the pipeline."""
        if self.ahead is not None and not self.ahead.skip:
            self.ahead.skip = True
            executor.skip_training(self.ahead.seq)

    async def _discard_ahead(self, executor, *sent: Sent | None) -> None:
        """The job ended or failed: the micro-batch sent ahead is called off (if it has not
        started), and the calls sent for it are waited for, their results unused."""
        self.skip_ahead(executor)
        calls = [s.call for s in (*sent, self.ahead) if s is not None]
        self.ahead = None
        await asyncio.gather(*calls, return_exceptions=True)

    def workers_replaced(self) -> None:
        """The workers were restarted after a failure: a running job's trainer is gone."""
        job = self.queue[0] if self.queue and self.queue[0].started else None
        self.busy.reset()
        if self.ahead is not None:  # sent to the old workers
            self.ahead.call.cancel()
            self.ahead = None
        if job is not None:
            job.started = False
            self._fail(job, "the workers were restarted after a failure; the job's training "
                       "state was lost")

    async def take_back(self, executor, kv) -> bool:
        """Before inference runs again: the workers map the lent KV blocks again, and the
        pool has them back. A worker that cannot (its device's memory is held elsewhere)
        fails the running job, whose trainer is freed, and tries once more. False: the
        workers still cannot (or are gone) and must be replaced."""
        for attempt in range(2):
            start = time.monotonic()
            try:
                await executor.finetune("take_back", "")
            except ray.exceptions.RayError as e:
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                logger.error("mapping the KV blocks lent to fine-tuning again failed: %s", reason)
                job = self.queue[0] if self.queue and self.queue[0].started else None
                if attempt or job is None:
                    return False
                self._fail(job, "the memory lent to training could not be returned to the "
                           f"KV cache: {reason}")
                await self._drop(job, executor)
                continue
            kv.take_back()
            self.num_take_backs += 1
            took = time.monotonic() - start
            self.take_back_s = took if self.take_back_s is None \
                else 0.8 * self.take_back_s + 0.2 * took
            return True
        return False

    async def _drop(self, job: Job, executor) -> None:
        """Free the job's trainer (parameters, gradients, optimizer state) on the worker."""
        if job.started:
            job.started = False
            try:
                await executor.finetune("drop", job.id)
            except ray.exceptions.RayError as e:  # the worker is gone, and its memory too
                logger.warning("freeing fine-tuning job %s's trainer failed: %s", job.id,
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
