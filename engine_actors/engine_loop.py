"""The iteration loop (ORCA Algorithm 1) around the scheduler and the worker group.

Each turn: expire missed deadlines, schedule up to `max_steps_in_flight` batches, wait for
the oldest step and apply its tokens. Outputs go to `deliver(outputs, error)` (the
scheduler actor's delivery to sinks). When a worker fails, the requests whose state lived
on the workers fail, the group is rebuilt with the same KV pool, and the loop goes on.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import ray

from engine_actors import finetune_jobs
from engine_actors.checkpoint import ModelInfo, model_info, resolve_model_path
from engine_actors.config import EngineConfig
from engine_actors.executor import Executor, PhaseClock, resolve_device
from engine_actors.messages import EngineRequest, Refusal, RequestOutput
from engine_actors.metrics import EngineMetrics
from engine_actors.request import Request
from engine_actors.scheduler import Batch, RequestRejected, Scheduler

logger = logging.getLogger("orca_serve.scheduler")
IDLE_WAKE_S = 2.0  # an idle loop still wakes this often, to expire deadlines
WORKER_FAILURE = "the engine's workers failed; the request was aborted (see the server log)"
DEADLINE_MISSED = "the request's deadline passed before it could start"

Deliver = Callable[[list[RequestOutput], "str | None"], None]


def show_info_logs() -> None:
    """Let the engine's INFO lines (its start, with each phase's time; its shutdown) reach
    this process's stderr, which `serve run` shows: a Ray actor's root logger has no handler,
    so only warnings got through (Python's last-resort handler)."""
    log = logging.getLogger("orca_serve")
    log.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        log.addHandler(handler)


class EngineLoop:
    def __init__(self, cfg: EngineConfig, info: ModelInfo, executor: Executor,
                 scheduler: Scheduler, metrics: EngineMetrics, deliver: Deliver):
        self.cfg, self.info = cfg, info
        self.executor, self.scheduler = executor, scheduler
        self.metrics, self.deliver = metrics, deliver
        self.depth, self.num_steps = cfg.max_steps_in_flight, 0
        self.iteration_s: float | None = None  # one step's time, averaged
        self._last_done = 0.0  # when the latest step ended
        self.last_tick = time.monotonic()  # the loop's heartbeat
        self.is_recovering = False
        self.last_arrival = -math.inf  # of a request
        self.finetuning = None  # FineTuning: jobs that run in idle time (finetune_jobs.py)
        self._wake = asyncio.Event()

    @classmethod
    async def start(cls, cfg: EngineConfig, workers_name: str, metrics: EngineMetrics,
                    deliver: Deliver, clock: PhaseClock | None = None) -> EngineLoop:
        """Start the workers, size the KV pool and build the scheduler. `clock` times the
        phases for the "engine ready" line (it may hold earlier phases)."""
        clock = clock or PhaseClock()
        resolve_model_path(cfg.model)  # a checkpoint that is not there: before anything starts
        device = resolve_device(cfg)
        # the workers' processes start, and the weights are read ahead, while the model's
        # config loads (transformers' imports: seconds) and is checked
        executor = Executor(cfg, device, name=workers_name)
        clock.lap("scheduler setup")
        placing = asyncio.ensure_future(executor.place(clock))
        try:
            info = await asyncio.to_thread(model_info, cfg)
            await placing
            clock.lap("model config")  # what was left of it once placed
            num_blocks = await executor.start(info, clock=clock)
            scheduler = Scheduler.from_config(cfg, num_blocks, info.max_model_len,
                                              info.eos_token_ids)
        except BaseException:
            placing.cancel()
            executor.shutdown()
            raise
        info = dataclasses.replace(info, max_model_len=scheduler.max_model_len)
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in clock.phases.items())
        logger.info("engine ready: %s on %s, %d KV blocks of %d tokens (kv_cache_dtype %s); "
                    "started in %.1f s (%s)", info.name, device, num_blocks, cfg.block_size,
                    cfg.kv_cache_dtype, sum(clock.phases.values()), phases)
        return cls(cfg, info, executor, scheduler, metrics, deliver)

    def queue_full(self) -> Refusal | None:
        waiting = self.scheduler.num_waiting
        return Refusal("queue_full", f"{waiting} requests are already waiting; retry later") \
            if waiting >= self.cfg.max_queued_requests else None

    def add(self, r: EngineRequest, sink, lora) -> Refusal | None:
        """Queue a request (its outputs go to `sink`; `lora`: its adapter or None)."""
        now = time.monotonic()
        deadline = now + r.deadline_ms / 1e3 if r.deadline_ms is not None else float("inf")
        try:
            self.scheduler.add(Request(r.request_id, r.prompt_token_ids, r.sampling, now, sink,
                                       r.priority, deadline, lora=lora, cache_salt=r.cache_salt))
        except RequestRejected as e:
            return Refusal("too_long", str(e))
        self.last_arrival = now
        if self.finetuning is not None:  # a micro-batch sent ahead is called off, and a
            self.finetuning.skip_ahead(self.executor)  # run of pieces stops
            self.finetuning.busy.interrupt(self.executor)
        self.wake()
        return None

    def wake(self) -> None:
        """New work arrived."""
        self._wake.set()

    async def run(self) -> None:
        """Iterate until cancelled; an unrecoverable failure fails every request and raises."""
        try:
            await self._iterate()
        except Exception:  # a bug or an unrecoverable failure: never leave requests hanging
            logger.exception("scheduler loop failed")
            self.deliver(self.scheduler.fail_all(), WORKER_FAILURE)
            raise

    async def _iterate(self) -> None:
        # steps launched and not yet processed, with their launch times
        in_flight: collections.deque[tuple[Batch, asyncio.Future, float]] = collections.deque()
        while True:
            self.last_tick = time.monotonic()
            expired = self.scheduler.expire(time.monotonic())
            if expired:
                self.deliver(expired, DEADLINE_MISSED)
            now = time.monotonic()
            ft = self.finetuning
            # (a micro-batch sent ahead is always taken before inference runs)
            if not in_flight and ft is not None and (
                    ft.ahead or ft.wants_step(self.scheduler, now)):
                if await ft.step(self.executor, self.scheduler.kv, pipeline=self._quiet):
                    await self._replace_workers()  # requests are deferred; a worker died
                    self.scheduler.kv.take_back()
                continue
            kv = self.scheduler.kv
            if kv.num_lent_blocks and not await ft.busy.settle_lent(self.executor,
                                                                    self.scheduler):
                # what training borrowed cannot be mapped again: new workers, a whole pool
                await self._workers_failed(in_flight)
                kv.take_back()
                continue
            hold_from = None  # FineInfer's deferral of new requests (finetune_jobs.py)
            if self.finetuning is not None and self.finetuning.queue:
                hold_from = self.finetuning.hold_from(time.monotonic(), self._drain_s())
            # (a training piece takes no step's place: steps stay `depth` deep)
            while sum(b is not None for b, _, _ in in_flight) < self.depth:
                piece = ft.busy.launch(self.executor, kv, self.scheduler.num_running > 0,
                                       self._admissible(hold_from)) if ft is not None else None
                if piece is not None:  # training in pieces (finetune_busy.py)
                    in_flight.append((None, piece, time.monotonic()))
                    continue
                preempted = self.scheduler.num_preemptions
                batch = self.scheduler.schedule(hold_from)
                self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
                if batch is None:
                    break
                self._observe(batch)
                in_flight.append((batch, asyncio.ensure_future(self.executor.execute(batch.step)),
                                  time.monotonic()))
                self.num_steps += 1
            if not in_flight:
                self._wake.clear()
                wait_s = IDLE_WAKE_S  # wake up for new work, to expire deadlines of waiting
                retry_s = self.finetuning and self.finetuning.wake_in(time.monotonic())
                if retry_s:  # requests, or for a job that waits for memory
                    wait_s = min(wait_s, retry_s)
                try:
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                except asyncio.TimeoutError:
                    pass
                continue
            batch, step, launched = in_flight.popleft()
            if batch is None:  # a training piece
                if await ft.busy.done(step, self.executor):
                    await self._workers_failed(in_flight)
                    continue
                ft.busy.earn(self._ended(launched))
                continue
            try:
                sampled = await step
            except ray.exceptions.RayError:
                logger.exception("worker failed")
                await self._workers_failed(in_flight)
                continue
            took = self._ended(launched)
            self.iteration_s = took if self.iteration_s is None \
                else 0.9 * self.iteration_s + 0.1 * took
            if ft is not None:
                ft.busy.earn(took)
            self.deliver(self.scheduler.process(batch, sampled), None)

    def _ended(self, launched: float) -> float:
        """A step or piece has ended: it ran from its launch or its predecessor's end."""
        done = time.monotonic()
        took, self._last_done = done - max(launched, self._last_done), done
        return took

    async def _workers_failed(self, in_flight: collections.deque) -> None:
        """A worker failed: what is in flight is dropped, the requests whose state lived
        on the workers fail, and the workers are replaced."""
        for _, other, _ in in_flight:
            other.cancel()
        in_flight.clear()
        self.deliver(self.scheduler.fail_started(), WORKER_FAILURE)
        await self._replace_workers()

    async def _replace_workers(self) -> None:
        """New workers hold no KV and no adapter: no block is cached, no slot loaded."""
        self.scheduler.kv.pool.forget_cached()
        if self.scheduler.loras is not None:
            self.scheduler.loras.reset()
        await self._restart_workers()

    def _admissible(self, hold_from: float | None) -> bool:
        """Requests wait that the next step may admit (not held by FineInfer's deferral)."""
        return any(hold_from is None or r.arrival_time < hold_from or r.num_iterations
                   for r in self.scheduler.waiting)

    def _quiet(self) -> bool:
        """A lull: fine-tuning's next micro-batch may wait on the workers (calls hidden)."""
        return not self.scheduler.pool \
            and time.monotonic() - self.last_arrival >= finetune_jobs.QUIET_S

    def _drain_s(self) -> float:
        """Estimated time until the running batch is empty: its longest remaining decode
        (max_tokens, as EOS may not come) at the measured iteration time."""
        longest = max((r.sampling.max_tokens - r.num_output_tokens
                       for r in self.scheduler.admitted.values()), default=0)
        if longest and self.iteration_s is None:
            return float("inf")  # no iteration measured yet
        return longest * (self.iteration_s or 0.0)

    def _observe(self, batch: Batch) -> None:
        now = time.monotonic()
        self.metrics.batch_requests.observe(len(batch.scheduled))
        self.metrics.batch_tokens.observe(batch.step.num_tokens)
        for req in (item.request for item in batch.scheduled):
            if req.num_iterations == 1 and req.num_preemptions == 0:  # its first iteration
                self.metrics.queue_time.observe(now - req.arrival_time)

    async def _restart_workers(self) -> None:
        """Replace the worker group after a failure, with the same KV pool size."""
        self.is_recovering = True
        try:
            name = self.executor.name
            self.executor.shutdown()
            self.executor = Executor(self.cfg, resolve_device(self.cfg), name=name)
            await self.executor.start(self.info, self.scheduler.kv.num_blocks)
        finally:
            self.is_recovering = False
            if self.finetuning is not None:
                self.finetuning.workers_replaced()

    def stats(self) -> dict:
        s = self.scheduler
        return {"heartbeat_age_s": time.monotonic() - self.last_tick,
                "num_requests": s.num_requests, "num_waiting": s.num_waiting,
                "num_running": s.num_running, "kv_usage": s.kv.usage,
                "num_free_blocks": s.kv.num_free_blocks, "num_blocks": s.kv.num_blocks,
                "num_lent_blocks": s.kv.num_lent_blocks,
                "num_steps": self.num_steps, "num_preemptions": s.num_preemptions,
                "prefix_cache_hit_rate": s.kv.num_hit_tokens / max(1, s.kv.num_queried_tokens)}

    def update_gauges(self) -> None:
        s = self.scheduler
        self.metrics.running.set(s.num_running)
        self.metrics.waiting.set(s.num_waiting)
        self.metrics.kv_usage.set(s.kv.usage)
        self.metrics.finetune_lent_blocks.set(s.kv.num_lent_blocks)
        self.metrics.prefix_cache(s.kv.num_queried_tokens, s.kv.num_hit_tokens)
        if s.speculator is not None:
            self.metrics.speculation(s.speculator)

    async def drain(self, timeout_s: float, searching=bool) -> list[RequestOutput]:
        """Wait up to timeout_s for the requests (and searches) to end; abort those left."""
        deadline = time.monotonic() + timeout_s
        while (self.scheduler.pool or searching()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.scheduler.fail_all()

    def shutdown(self) -> None:
        self.executor.shutdown()
