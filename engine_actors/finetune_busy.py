"""Fine-tuning while requests run: a share of the GPU's time, in pieces between inference
steps (`finetune_busy_share`; the pieces themselves: finetune_pieces.py).

FineInfer's rule (finetune_jobs.py) trains only when no request runs. At half load this
engine has requests running nearly all the time, so a job barely trains (BENCHMARKS.md,
2026-11-25). With a share f > 0 the engine loop also sends training pieces while requests
run. Every step or piece that ends earns f of its time; a piece is sent once the credit is
positive, and its device time, measured on the worker, is spent. So training takes about f
of the time, and each running request's step comes at least f/(1 - f) later (more under
load: the load's own work keeps its share; BENCHMARKS.md, 2026-11-26). A request that
arrives waits for the piece in flight at most, a few milliseconds, not a whole micro-batch:
while requests wait to be admitted, no piece is sent, so their step goes first (and an
engine at its capacity, where requests always wait, does not train beside them at all).

One piece or start is in flight at a time, in the steps' order on every worker
(executor.finetune). The micro-batch gets only the memory free beside the KV pool:
nothing is lent while requests run. Once no request is left, a micro-batch begun in
pieces finishes in pieces, back to back; then FineInfer's whole micro-batches go on, or, in
a gap between requests too short for one (a whole micro-batch longer than the deferral
bound waits for a lull: finetune_jobs.py), new micro-batches in pieces, back to back. A
request that arrives then waits for one piece at most: FineInfer's deferral holds no request
while a micro-batch is in pieces (no whole one could run).
"""
from __future__ import annotations

import asyncio
import time

import ray

from engine_actors import finetune_steps
from engine_actors.finetune_job import Job
from engine_actors.finetune_memory import plan_micro_batch

CREDIT_CAP_S = 0.01  # time earned and not spent does not pile up past this


class BusyTraining:
    def __init__(self, ft, share: float):
        self.ft, self.share = ft, share  # ft: FineTuning (finetune_jobs.py)
        self.credit = 0.0  # seconds of device time training may still take
        self.job: Job | None = None  # whose micro-batch is in pieces now
        self.batch: tuple[int, bool] = (0, False)  # its batch's trained tokens, last or not
        self.call: tuple[str, Job, bool] | None = None  # in flight: kind, job, sent busy
        self.num_pieces = 0
        self.piece_s: float | None = None  # a piece's device time, averaged
        self.busy_s = 0.0  # device time of the pieces run while requests ran, in all
        self.gap_s = 0.0  # and of those run while none ran
        self.retry_at = 0.0  # no micro-batch fitted beside the pool: not before then

    @property
    def active(self) -> bool:
        """A micro-batch is in pieces or a call is in flight: no whole micro-batch runs."""
        return self.job is not None or self.call is not None

    def earn(self, took: float) -> None:
        """A step or piece that took `took` seconds ended."""
        self.credit = min(self.credit + self.share * took, CREDIT_CAP_S)

    def launch(self, executor, kv, busy: bool, waiting: bool) -> asyncio.Future | None:
        """The call to put in flight now (the queue's first job's start, or the next piece
        of its micro-batch), or None. `busy`: requests are running; `waiting`: requests
        wait to be admitted (their step goes first)."""
        ft = self.ft
        if self.call is not None or waiting:
            return None
        if self.job is not None and self.job.status != "running":
            self.job = None  # cancelled or failed: its pieces were dropped with its trainer
        if self.job is None:
            # with no request running, FineInfer's whole micro-batch did not start (the engine
            # loop asks it first): a gap shorter than its lull, trained in pieces
            if not ft.queue or time.monotonic() < max(ft.retry_at, self.retry_at) \
                    or (busy and self.credit <= 0):
                return None
            job = ft.queue[0]
            if not job.started:
                self.call = ("start", job, busy)
                return asyncio.ensure_future(ft.start_call(job, executor))
            try:  # no KV block is lent while requests run
                planned = plan_micro_batch(job, kv, {**ft.memory, "lendable_units": 0},
                                           ft.cfg.finetune_max_tokens)
            except ValueError:  # its next example needs lent blocks: when requests are gone
                planned = None
            if planned is None:
                self.retry_at = time.monotonic() + finetune_steps.MEMORY_RETRY_S
                return None
            micro = planned[1]
            self.job, self.batch = job, job.take_micro(micro)
            args = ([job.examples[i][0] for i in micro], [job.examples[i][1] for i in micro],
                    *self.batch)
        elif busy and self.credit <= 0:
            return None
        else:
            args = ()
        self.call = ("piece", self.job, busy)
        return asyncio.ensure_future(executor.finetune("piece", self.job.id, *args))

    async def done(self, call: asyncio.Future, executor) -> bool:
        """The call in flight has ended: its result recorded, or its job failed. True: a
        worker is gone (the workers must be replaced, which fails the job)."""
        (kind, job, busy), self.call = self.call, None
        try:
            out = await call
        except ray.exceptions.RayError as e:
            self.job = None
            if isinstance(e, ray.exceptions.RayActorError):
                return True
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e
            if job.status == "running":
                self.ft._fail(job, f"{type(cause).__name__}: {cause}".splitlines()[0])
            await self.ft._drop(job, executor)
            return False
        if kind == "start":
            self.ft.started(job, out)
            return False
        self.num_pieces += 1
        self.piece_s = out["gpu_s"] if self.piece_s is None \
            else 0.9 * self.piece_s + 0.1 * out["gpu_s"]
        if busy:
            self.credit -= out["gpu_s"]
            self.busy_s += out["gpu_s"]
        else:
            self.gap_s += out["gpu_s"]
        if out["done"]:
            self.job = None
            self.ft.memory = {**self.ft.memory, "free_bytes": out["free_bytes"]}
            if job.status == "running":
                await self.ft.record(job, out, *self.batch, executor)
        return False

    def reset(self) -> None:
        """The workers were replaced: whatever was in pieces is gone."""
        self.job, self.call, self.credit, self.retry_at = None, None, 0.0, 0.0
