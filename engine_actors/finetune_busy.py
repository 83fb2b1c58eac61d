"""Fine-tuning micro-batches in pieces (the pieces themselves: finetune_pieces.py): between
requests when a whole one would hold them past the deferral bound, and beside running
requests with a share of the GPU's time (`finetune_busy_share`).

Between requests: FineInfer's rule (finetune_jobs.py) runs a whole micro-batch when no
request runs, and whoever arrives during it waits for all of it. When that is longer than
the bound, no quiet spell makes it safe (arrivals are memoryless: at 2 req/s whole ones
raised TTFT p99 tenfold, BENCHMARKS.md 2026-11-26), so the job's micro-batches run in pieces
instead: while no request runs, one call runs the rest of a micro-batch's pieces back to
back on the worker (a call a piece cost a quarter of the speed: BENCHMARKS.md, 2026-11-27),
and a request that arrives stops it after its current piece (`interrupt`), so it waits a
few milliseconds, not a micro-batch. Such a micro-batch may borrow free KV blocks (finetune_memory.py), as a
whole one does; a request arriving then runs beside it on the other blocks while the
micro-batch pauses, and one that needs the lent blocks has it called off (its activations
freed, its examples next again) and the blocks mapped back before its first step.

Beside requests: with a share f > 0, every step or piece that ends earns f of its time; a
piece is sent once the credit is positive, and its device time, measured on the worker, is
spent. So training takes about f of the time, and each running request's step comes at
least f/(1 - f) later (more under load: the load's own work keeps its share; BENCHMARKS.md,
2026-11-26). A call is one piece then, and no more blocks are lent while requests run.
While requests wait to be admitted, no piece is sent, so their step goes first (and an
engine at its capacity, where requests always wait, does not train beside them at all).

Every piece or start takes its turn among the steps on every worker (executor.finetune).
FineInfer's deferral holds no request while a micro-batch is in pieces (no whole one could
run).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time

import ray

from engine_actors import finetune_steps
from engine_actors.finetune_job import Job
from engine_actors.finetune_memory import plan_micro_batch

logger = logging.getLogger("orca_serve.finetune")
CREDIT_CAP_S = 0.01  # time earned and not spent does not pile up past this
RUN_ALL = 1 << 30  # pieces a run between requests may take: the rest of its micro-batch
MAX_STOP_WAITS = 4096


class BusyTraining:
    def __init__(self, ft, share: float):
        self.ft, self.share = ft, share  # ft: FineTuning (finetune_jobs.py)
        self.credit = 0.0  # seconds of device time training may still take
        self.job: Job | None = None  # whose micro-batch is in pieces now
        self.batch: tuple[int, bool] = (0, False)  # its batch's trained tokens, last or not
        self.micro: list[int] = []  # its examples
        self.num_micro = 0  # micro-batches begun in pieces, in all (the latest one's number)
        # in flight: kind, job, sent while requests ran, its run's number
        self.call: tuple[str, Job, bool, int] | None = None
        self.num_runs = 0
        self.num_pieces = 0
        self.piece_s: float | None = None  # a piece's device time, averaged
        self.busy_s = 0.0  # device time of the pieces run while requests ran, in all
        self.gap_s = 0.0  # and of those run while none ran
        self.micro_s = 0.0  # device time of the pieces of the micro-batch in pieces
        self.retry_at = 0.0  # no micro-batch fitted beside the pool: not before then
        # (job, number) of the micro-batch whose activations live in lent KV blocks
        self.lent: tuple[Job, int] | None = None
        self.num_called_off = 0
        self.stopped_at: float | None = None  # when the run in flight was told to stop
        # from then until its end, for the latest stopped runs (/health)
        self.stop_waits: collections.deque[float] = collections.deque(maxlen=MAX_STOP_WAITS)

    @property
    def active(self) -> bool:
        """A micro-batch is in pieces or a call is in flight: no whole micro-batch runs."""
        return self.job is not None or self.call is not None

    @property
    def holds_lent(self) -> bool:
        """A micro-batch in pieces holds KV blocks lent to it: they are not taken back."""
        if self.lent is not None and self.lent[0].status != "running" and self.call is None:
            self.lent = None  # its job ended (its trainer and pieces dropped)
        return self.lent is not None

    def earn(self, took: float) -> None:
        """A step or piece that took `took` seconds ended."""
        self.credit = min(self.credit + self.share * took, CREDIT_CAP_S)

    def launch(self, executor, kv, busy: bool, waiting: bool) -> asyncio.Future | None:
        """The call to put in flight now (the queue's first job's start, or a run of pieces
        of its micro-batch or of a new one), or None. `busy`: requests are running (one
        piece, paid for by the share); else the run takes the rest of the micro-batch,
        until a request comes (`interrupt`). `waiting`: requests wait to be admitted
        (their step goes first)."""
        ft = self.ft
        if self.job is not None and self.job.status != "running":
            self.job = None  # cancelled or failed: its pieces were dropped with its trainer
        if waiting or self.call is not None or (busy and self.credit <= 0):
            return None
        if self.job is not None:
            job, args = self.job, ()
        else:  # (between requests, a micro-batch that fits the bound runs whole instead)
            if not ft.queue or not busy and not ft.in_pieces \
                    or time.monotonic() < max(ft.retry_at, self.retry_at):
                return None
            job = ft.queue[0]
            if not job.started:  # (its trainer's state must not sit in lent blocks)
                if kv.num_lent_blocks:
                    return None
                self.call = ("start", job, busy, 0)
                return asyncio.ensure_future(ft.start_call(job, executor))
            if job.status != "running":
                return None
            try:  # KV blocks are lent only while no request runs
                planned = plan_micro_batch(job, kv, ft.memory if not busy else
                                           {**ft.memory, "lendable_units": 0},
                                           ft.cfg.finetune_max_tokens)
            except ValueError as e:  # its next example needs more than is free now
                if busy:  # (lent blocks too: when requests are gone)
                    planned = None
                else:  # more than the whole pool: it never fits, and the job fails
                    ft._fail(job, str(e))
                    self.call = ("drop", job, busy, 0)
                    return asyncio.ensure_future(ft._drop(job, executor))
            if planned is None:
                self.retry_at = time.monotonic() + finetune_steps.MEMORY_RETRY_S
                return None
            units, self.micro = planned
            self.job, self.batch, self.micro_s = job, job.take_micro(self.micro), 0.0
            self.num_micro += 1
            if units:
                self.lent = (job, self.num_micro)
            args = (units, [job.examples[i][0] for i in self.micro],
                    [job.examples[i][1] for i in self.micro], *self.batch)
        self.num_runs += 1
        self.call = ("piece", job, busy, self.num_runs)
        return asyncio.ensure_future(executor.finetune(
            "piece", job.id, self.num_runs, 1 if busy else RUN_ALL, *args))

    def interrupt(self, executor) -> None:
        """A request came: a run of pieces between requests stops after its current piece."""
        if self.call is not None and self.call[0] == "piece" and not self.call[2] \
                and self.stopped_at is None:
            self.stopped_at = time.monotonic()
            executor.stop_training(self.call[3])

    async def done(self, call: asyncio.Future, executor) -> bool:
        """The call in flight has ended: its result recorded, or its job failed. True: a
        worker is gone (the workers must be replaced, which fails the job)."""
        if self.call is None:  # the workers were replaced meanwhile (`reset`)
            return False
        kind, job, busy, _ = self.call
        try:
            out = await call  # (still in flight meanwhile: a request may interrupt it)
        except ray.exceptions.RayError as e:
            self._ended_stop()
            self.call = self.job = self.lent = None  # the worker freed its activations
            if isinstance(e, ray.exceptions.RayActorError):
                return True
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e
            if job.status == "running":
                self.ft._fail(job, f"{type(cause).__name__}: {cause}".splitlines()[0])
            await self.ft._drop(job, executor)
            return False
        self._ended_stop()
        self.call = None
        if kind == "start":
            self.ft.started(job, out)
        if kind != "piece":
            return False
        self.num_pieces += out["ran"]
        if out["ran"]:  # (none: a request stopped the run before its first piece)
            piece_s = out["gpu_s"] / out["ran"]
            self.piece_s = piece_s if self.piece_s is None \
                else 0.9 * self.piece_s + 0.1 * piece_s
        self.micro_s += out["gpu_s"]
        if busy:
            self.credit -= out["gpu_s"]
            self.busy_s += out["gpu_s"]
        else:
            self.gap_s += out["gpu_s"]
        if out["done"]:
            self.job = self.lent = None
            self.ft.memory = {**self.ft.memory, "free_bytes": out["free_bytes"]}
            self.ft.measure_pieces(self.micro_s, out["tokens"])
            if job.status == "running":
                await self.ft.record(job, out, *self.batch, executor)
        return False

    def stop_wait_ms(self) -> dict:
        """How long runs took to stop for a request that came (the latest runs')."""
        waits = sorted(self.stop_waits)
        out = {"count": len(waits)}
        for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)) if waits else ():
            out[name] = round(waits[min(len(waits) - 1, int(q * len(waits)))] * 1e3, 1)
        return out

    def _ended_stop(self) -> None:
        """The call in flight ended: if a request stopped it, how long that took (what the
        request waited for training)."""
        if self.stopped_at is not None:
            self.stop_waits.append(time.monotonic() - self.stopped_at)
            self.stopped_at = None

    async def call_off(self, executor) -> bool:
        """Requests need the KV blocks lent to the micro-batch in pieces: it is called off
        (its activations freed on the workers, its examples next again), so they can be
        taken back. Only while none of its pieces is in flight (False: not now)."""
        if self.call is not None or self.job is None or self.lent is None:
            return False
        job, self.job, self.lent = self.job, None, None
        try:
            await executor.finetune("call_off", job.id)
        except ray.exceptions.RayError as e:  # the workers are gone: taking the blocks back
            # fails next, and the workers are replaced
            logger.warning("calling off a micro-batch in pieces failed: %s",
                           str(e).splitlines()[0] if str(e) else type(e).__name__)
        if job.status == "running":
            job.untake(self.micro)
        self.num_called_off += 1
        return True

    async def settle_lent(self, executor, scheduler) -> bool:
        """Before inference runs: the KV blocks lent to training stay lent while requests do
        not need them (`needs_lent_blocks`), whether a micro-batch in pieces holds them
        (requests run beside it on the other blocks) or the next one of the started job
        will reuse them: mapping them back, and lending them again, would hold up the
        request's step (~ms) for nothing. A micro-batch holding blocks that requests need is
        called off first, once none of its pieces is in flight. A new trainer's state must
        not sit in them, and nothing keeps them once no job trains. False: the workers
        cannot map them again and must be replaced."""
        needed = bool(scheduler.pool) and needs_lent_blocks(scheduler)
        if self.holds_lent and needed:
            await self.call_off(executor)  # (not while a piece is in flight: later)
        queue = self.ft.queue
        if self.holds_lent or not needed and queue and queue[0].started:
            return True
        return await self.ft.take_back(executor, scheduler.kv)

    def reset(self) -> None:
        """The workers were replaced: whatever was in pieces is gone."""
        self.job, self.call, self.lent, self.stopped_at = None, None, None, None
        self.credit, self.retry_at, self.micro_s = 0.0, 0.0, 0.0

def needs_lent_blocks(scheduler) -> bool:
    """Requests need the KV blocks lent to training when they could take more than the
    unreserved blocks within the next two steps, or when fewer are unreserved than are lent.
    They could take: what the waiting requests hold once admitted (those a step could admit,
    however the policy orders them: one skipped for its adapter hides none behind it), and
    for requests whose policy reserves less than their most tokens, which grow, a block each
    and a step's tokens, each step. (Running requests are never preempted for training's
    memory, nor left waiting for it.)"""
    kv, policy, budget = scheduler.kv, scheduler.policy, scheduler.budget
    waiting = scheduler.waiting[:budget.max_num_requests]
    take = sum(kv.blocks_for(max(policy.reservation(r), r.num_tokens)) for r in waiting)
    growing = sum(policy.reservation(r) < r.max_num_tokens
                  for r in itertools.chain(scheduler.admitted.values(), waiting))
    if growing:
        take += 2 * (growing + kv.blocks_for(budget.max_num_tokens))
    return kv.num_unreserved_blocks < max(kv.num_lent_blocks, take)
