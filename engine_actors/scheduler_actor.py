"""The singleton scheduler actor: request pool, iteration loop, batches in flight, streams out.

Every ingress replica is a *client*: it submits requests with `add_request` and holds one
long-lived `stream` call that yields, once per iteration, the new tokens of all of its
requests. One stream per replica instead of one per request keeps the actor's per-token
overhead independent of the number of requests.

Lifetime: created on first use by an ingress replica (a named, detached actor, one per
distinct configuration); it tears itself down, workers and placement group included, when
its last client unregisters, when the last stream breaks (or none ever opens) and no client
comes back within ORPHAN_GRACE_S, or when the engine fails in a way it cannot recover from.
The next request then brings a new one up.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import asdict

import ray

from engine_actors.batches import BatchState, prune
from engine_actors.checkpoint import ModelInfo, model_info
from engine_actors.config import EngineConfig
from engine_actors.executor import Executor, resolve_device
from engine_actors.kv_cache import KVCacheManager
from engine_actors.metrics import EngineMetrics
from engine_actors.policies import Budget, make_policy
from engine_actors.request import Request, SamplingParams
from engine_actors.scheduler import RequestOutput, RequestRejected, Scheduler

logger = logging.getLogger("orca_serve.scheduler")
NAMESPACE = "orca-serve"
ORPHAN_GRACE_S = 30.0
HEARTBEAT_S = 2.0
MAX_UNKNOWN_ABORTS = 4096
WORKER_FAILURE = "the engine's workers failed; the request was aborted (see the server log)"
DEADLINE_MISSED = "the request's deadline passed before it could start"


def actor_name(cfg: EngineConfig) -> str:
    return f"orca-scheduler-{cfg.fingerprint()}"


async def _is_alive(actor) -> bool:
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), HEARTBEAT_S)
        return True
    except ray.exceptions.ActorUnavailableError:  # transient (e.g. restarting): not dead
        return True
    except ray.exceptions.RayActorError:
        return False
    except asyncio.TimeoutError:  # alive but busy
        return True


class _Client:
    """Outputs waiting to be streamed to one ingress replica."""

    def __init__(self) -> None:
        self.pending: dict[str, dict] = {}
        self.event = asyncio.Event()
        self.request_ids: set[str] = set()


class SchedulerActor:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.info: ModelInfo | None = None
        self.scheduler: Scheduler | None = None
        self.executor: Executor | None = None
        self.clients: dict[str, _Client] = {}
        self.depth = cfg.max_steps_in_flight
        self.num_steps = 0
        self._wake = asyncio.Event()
        self._started: asyncio.Task | None = None
        self._start_error: str | None = None
        self._tasks: set[asyncio.Task] = set()  # background tasks, kept alive
        self._adding: set[str] = set()  # request ids whose add_request waits for the engine
        self._early_aborts: set[str] = set()  # ... and were aborted meanwhile
        # aborts of ids not (yet) known: Ray may run an abort before the add_request sent
        # ahead of it, so remember a bounded number of them
        self._unknown_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.batches: dict[str, BatchState] = {}
        self.state = "starting"  # starting -> ready <-> recovering; draining at the end
        self.last_tick = time.monotonic()  # the loop's heartbeat
        self.metrics = EngineMetrics(cfg.model_name)

    # ---- life cycle -------------------------------------------------------------------
    async def ready(self) -> dict:
        """Start the engine on first call; returns the model info once workers are ready."""
        if self._started is None:
            self._started = self._spawn(self._start())
            self._spawn(self._teardown_if_unused())  # nobody may ever connect
        await asyncio.shield(self._started)
        if self._start_error is not None:
            raise RuntimeError(self._start_error)
        return asdict(self.info)

    async def _start(self) -> None:
        try:
            self.info = model_info(self.cfg)
            device = resolve_device(self.cfg)
            self.executor = Executor(self.cfg, device, self.info.max_model_len,
                                     name=self._workers_name())
            num_blocks = await self.executor.start()
            self._fit_context_to_kv(num_blocks * self.cfg.block_size)
            kv = KVCacheManager(num_blocks, self.cfg.block_size, self.cfg.max_num_seqs)
            budget = Budget(self.cfg.max_batch_size, self.cfg.max_num_batched_tokens)
            continuation = self.cfg.async_scheduling and self.cfg.pipeline_parallel_size == 1
            self.scheduler = Scheduler(kv, make_policy(self.cfg.scheduling_policy), budget,
                                       self.info.max_model_len, set(self.info.eos_token_ids),
                                       allow_continuation=continuation)
            self._spawn(self._run())
            if self.state != "draining":
                self.state = "ready"
            logger.info("engine ready: %s on %s, %d KV blocks of %d tokens", self.info.name,
                        device, num_blocks, self.cfg.block_size)
        except Exception as e:
            logger.exception("engine start failed")
            self._start_error = f"engine failed to start: {type(e).__name__}: {e}"
            # every waiting caller gets the error; then go, so a retry starts from scratch
            self._spawn(self._teardown(delay_s=1.0))

    def _fit_context_to_kv(self, capacity: int) -> None:
        """A context longer than the KV pool could never be used: cap it (or refuse an
        explicit max_model_len), as vLLM refuses to start in that case."""
        if capacity >= self.info.max_model_len:
            return
        if self.cfg.max_model_len is not None:
            raise ValueError(f"max_model_len {self.cfg.max_model_len} exceeds the KV cache "
                             f"capacity of {capacity} tokens; lower it or raise max_num_tokens")
        logger.warning("max_model_len capped from %d to the KV cache capacity, %d tokens",
                       self.info.max_model_len, capacity)
        self.info = dataclasses.replace(self.info, max_model_len=capacity)

    def _workers_name(self) -> str:
        return f"{actor_name(self.cfg)}-workers"

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        """Fail what is left, stop the workers, free their devices, and exit."""
        if self.scheduler is not None:
            self._publish(self.scheduler.fail_all(), error="the engine was shut down")
        await self._teardown()

    async def unregister(self, client_id: str) -> None:
        """An ingress replica is shutting down; the last one takes the engine with it."""
        self._drop_client(client_id)
        if not self.clients:
            await self._teardown()

    async def _teardown_if_unused(self) -> None:
        """No client (a replica died, or none connected): wait for one, else go. The time
        the engine takes to start does not count."""
        if self._started is not None:
            await asyncio.shield(self._started)
        await asyncio.sleep(ORPHAN_GRACE_S)
        if not self.clients:
            await self._teardown()

    async def _teardown(self, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        logger.info("shutting the engine down")
        if self.executor is not None:
            self.executor.shutdown()
        # exit_actor() would wait for the open stream calls; nothing here needs a goodbye
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ---- requests ---------------------------------------------------------------------
    async def add_request(self, client_id: str, request_id: str, prompt_token_ids: list[int],
                          sampling: SamplingParams, priority: int = 0,
                          deadline_ms: float | None = None) -> dict | None:
        """Queue a request; returns None, or a refusal {"code", "message"}: "invalid" or
        "too_long" (it could never run), "queue_full", "draining".

        priority: higher runs first under the priority policy. deadline_ms: the request must
        start within this many milliseconds of arrival, or it ends with finish_reason
        "deadline" (any policy; DAS and EDF also order by it)."""
        self._adding.add(request_id)
        try:
            await self.ready()
        finally:
            self._adding.discard(request_id)
        if request_id in self._early_aborts or request_id in self._unknown_aborts:
            self._early_aborts.discard(request_id)
            self._unknown_aborts.pop(request_id, None)
            return None  # aborted before it was added
        refusal = sampling.check()
        if refusal is not None:
            return {"code": "invalid", "message": refusal}
        if self.state == "draining":
            return {"code": "draining", "message": "the server is shutting down"}
        if self.scheduler.num_waiting >= self.cfg.max_queued_requests:
            return {"code": "queue_full", "message": f"{self.scheduler.num_waiting} requests "
                    "are already waiting; retry later"}
        is_batch = client_id.startswith("batch:")  # outputs collected here, not streamed
        client = None if is_batch else self.clients.setdefault(client_id, _Client())
        now = time.monotonic()
        deadline = now + deadline_ms / 1e3 if deadline_ms is not None else float("inf")
        req = Request(request_id, prompt_token_ids, sampling, now, client_id,
                      priority=priority, deadline=deadline)
        try:
            self.scheduler.add(req)
        except RequestRejected as e:
            return {"code": "too_long", "message": str(e)}
        if client is not None:
            client.request_ids.add(request_id)
        self._wake.set()
        return None

    async def add_requests(self, client_id: str,
                           requests: list[tuple[str, list[int], SamplingParams]]) -> list[str | None]:
        """Queue several requests in one call (they join the same iteration)."""
        return [await self.add_request(client_id, *r) for r in requests]

    # ---- background batches -------------------------------------------------------------
    async def submit_batch(self, batch_id: str, requests: list[tuple], priority: int = 0
                           ) -> dict | None:
        """Queue a batch's requests, each (prompt ids, SamplingParams, deadline_ms, stop
        strings); all or nothing: returns None, or why one was refused ("request i: ...")."""
        await self.ready()
        prune(self.batches, time.time())
        if len(requests) > self.cfg.max_queued_requests:
            return {"code": "batch_too_large",
                    "message": f"a batch of {len(requests)} requests can never fit the queue "
                               f"of {self.cfg.max_queued_requests}; split it"}
        state = self.batches[batch_id] = BatchState(batch_id, len(requests),
                                                    [r[3] for r in requests])
        client_id = BatchState.client_id(batch_id)
        for i, (ids, sampling, deadline_ms, _) in enumerate(requests):
            refusal = await self.add_request(client_id, state.request_id(i), ids, sampling,
                                             priority, deadline_ms)
            if refusal is not None:
                self.abort([state.request_id(j) for j in range(i)])
                del self.batches[batch_id]
                return {"code": refusal["code"], "message": f"request {i}: {refusal['message']}"}
        return None

    def batch_status(self, batch_id: str) -> dict | None:
        prune(self.batches, time.time())
        state = self.batches.get(batch_id)
        return state.status() if state else None

    def cancel_batch(self, batch_id: str) -> dict | None:
        state = self.batches.get(batch_id)
        if state is None:
            return None
        if len(state.results) < state.num_requests:  # a finished batch stays as it ended
            state.cancelled = True
        self.abort([state.request_id(i) for i in range(state.num_requests)
                    if i not in state.results])
        return state.status()

    async def batch_results(self, batch_id: str):
        """Yields lists of finished results (token ids), the ones already finished first,
        until every request of the batch has finished."""
        state = self.batches.get(batch_id)
        if state is None:
            return
        sent: set[int] = set()
        while True:
            changed = state.changed  # replaced (and set) on every change: no reader misses one
            new = [state.result(i) for i in state.results if i not in sent]
            sent.update(r["index"] for r in new)
            if new:
                yield new
            if len(sent) == state.num_requests:
                return
            await changed.wait()

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            out = self.scheduler.abort(rid) if self.scheduler else None
            if out is not None and out.client_id.startswith("batch:"):
                self._publish_to_batch(out, "cancelled")
            elif out is not None:
                self._forget(out)
            elif rid in self._adding:
                self._early_aborts.add(rid)
            else:
                self._unknown_aborts[rid] = None
                while len(self._unknown_aborts) > MAX_UNKNOWN_ABORTS:
                    self._unknown_aborts.popitem(last=False)

    async def stream(self, client_id: str, owner=None):
        """Yields {request_id: output} with every output for this client since the last yield.

        `owner` is the calling replica's actor handle: Ray does not end this call when the
        caller dies, so the stream checks now and then that its owner is still alive.
        """
        client = self.clients.setdefault(client_id, _Client())
        last_check = time.monotonic()
        try:
            while True:
                try:
                    await asyncio.wait_for(client.event.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    pass
                if owner is not None and time.monotonic() - last_check > HEARTBEAT_S:
                    last_check = time.monotonic()
                    if not await _is_alive(owner):
                        return
                client.event.clear()
                batch, client.pending = client.pending, {}
                if batch:
                    yield batch
        finally:
            # the replica is gone (or cancelled its stream): nobody can receive these tokens
            self._drop_client(client_id)
            if not self.clients:
                self._spawn(self._teardown_if_unused())

    def stats(self) -> dict:
        s = self.scheduler
        return {"state": self.state,
                "heartbeat_age_s": time.monotonic() - self.last_tick,
                "num_requests": s.num_requests if s else 0,
                "num_waiting": s.num_waiting if s else 0,
                "num_running": s.num_running if s else 0,
                "kv_usage": s.kv.usage if s else 0.0,
                "num_free_blocks": s.kv.num_free_blocks if s else 0,
                "num_blocks": s.kv.num_blocks if s else 0,
                "num_steps": self.num_steps,
                "num_preemptions": s.num_preemptions if s else 0,
                "num_clients": len(self.clients)}

    async def health(self) -> dict:
        """stats(), plus whether every worker answers (a dead worker is not only slow)."""
        stats = self.stats()
        stats["workers_alive"] = bool(self.executor) and await self.executor.all_alive()
        return stats

    def metrics_text(self) -> bytes:
        s = self.scheduler
        if s is not None:
            self.metrics.running.set(s.num_running)
            self.metrics.waiting.set(s.num_waiting)
            self.metrics.kv_usage.set(s.kv.usage)
        return self.metrics.render()

    async def inject_fault(self, worker_index: int = 0) -> None:
        """Make worker `worker_index` raise in its next step (chaos testing)."""
        await self.ready()
        await self.executor.workers[worker_index].fail_next_step.remote()

    async def drain(self, timeout_s: float) -> None:
        """Shutting down: refuse new requests, let running ones finish for up to timeout_s,
        then end the rest with finish_reason "abort"."""
        self.state = "draining"
        deadline = time.monotonic() + timeout_s
        while self.scheduler and self.scheduler.pool and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.scheduler and self.scheduler.pool:
            self._publish(self.scheduler.fail_all())  # plain finish_reason "abort"

    async def workers(self) -> list:
        """The worker actor handles, stage-major (for operations and tests)."""
        await self.ready()
        return list(self.executor.workers)

    async def step_traces(self) -> list[list[tuple]]:
        """Per worker: (step, arrived, launched, enqueued, done) wall-clock times of its
        latest steps (diagnosis of pipelining)."""
        await self.ready()
        return await self.executor.step_traces()

    async def gpu_timeline(self, reset: bool = False) -> list[dict]:
        """Per worker: GPU busy time and idle time between steps (see StepTimeline)."""
        await self.ready()
        return await self.executor.gpu_timeline(reset)

    # ---- the iteration loop (ORCA Algorithm 1) ------------------------------------------
    async def _run(self) -> None:
        try:
            await self._iterate()
        except Exception:  # a bug or an unrecoverable failure: never leave requests hanging
            logger.exception("scheduler loop failed")
            self._publish(self.scheduler.fail_all(), error=WORKER_FAILURE)
            await self._teardown()

    async def _iterate(self) -> None:
        in_flight: collections.deque = collections.deque()
        while True:
            self.last_tick = time.monotonic()
            expired = self.scheduler.expire(time.monotonic())
            if expired:
                self._publish(expired, error=DEADLINE_MISSED)
            while len(in_flight) < self.depth:
                preempted = self.scheduler.num_preemptions
                batch = self.scheduler.schedule(time.monotonic())
                self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
                if batch is None:
                    break
                self._observe(batch)
                step = asyncio.ensure_future(self.executor.execute(batch.step))
                in_flight.append((batch, step))
                self.num_steps += 1
            if not in_flight:
                self._wake.clear()
                try:  # wake up for new work, or to expire deadlines of waiting requests
                    await asyncio.wait_for(self._wake.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    pass
                continue
            batch, step = in_flight.popleft()
            try:
                sampled = await step
            except ray.exceptions.RayError:
                logger.exception("worker failed")
                for _, other in in_flight:
                    other.cancel()
                in_flight.clear()
                self._publish(self.scheduler.fail_started(), error=WORKER_FAILURE)
                if self.state != "draining":
                    self.state = "recovering"
                await self._restart_workers()
                if self.state != "draining":
                    self.state = "ready"
                continue
            self._publish(self.scheduler.process(batch, sampled))

    def _observe(self, batch) -> None:
        now = time.monotonic()
        self.metrics.batch_requests.observe(len(batch.scheduled))
        self.metrics.batch_tokens.observe(batch.step.num_tokens)
        for item in batch.scheduled:
            req = item.request
            if req.num_iterations == 1 and req.num_preemptions == 0:  # its first iteration
                self.metrics.queue_time.observe(now - req.arrival_time)

    async def _restart_workers(self) -> None:
        """Replace the worker group after a failure, with the same KV pool size."""
        self.executor.shutdown()
        self.executor = Executor(self.cfg, resolve_device(self.cfg), self.info.max_model_len,
                                 name=self._workers_name())
        await self.executor.start(num_blocks=self.scheduler.kv.num_blocks)

    def _publish(self, outputs: list[RequestOutput], error: str | None = None) -> None:
        for out in outputs:
            if out.client_id.startswith("batch:"):
                self._publish_to_batch(out, error)
                continue
            client = self.clients.get(out.client_id)
            if client is None:
                continue
            item = client.pending.get(out.request_id)
            if item is None:
                item = client.pending[out.request_id] = {"token_ids": [], "finish_reason": None}
            item["token_ids"].extend(out.new_token_ids)
            item["num_prompt_tokens"] = out.num_prompt_tokens
            item["num_output_tokens"] = out.num_output_tokens
            if out.finish_reason is not None:
                self.metrics.finished(out.finish_reason)
                item["finish_reason"] = out.finish_reason
                if error is not None:
                    item["error"] = error
                client.request_ids.discard(out.request_id)
            client.event.set()

    def _publish_to_batch(self, out: RequestOutput, error: str | None) -> None:
        batch_id, _, index = out.request_id.rpartition("-")
        state = self.batches.get(batch_id)
        if state is not None:
            state.add_output(int(index), out.new_token_ids, out.finish_reason,
                             out.num_prompt_tokens, error if out.finish_reason else None)

    def _forget(self, out: RequestOutput) -> None:
        client = self.clients.get(out.client_id)
        if client is not None:
            client.request_ids.discard(out.request_id)
            client.pending.pop(out.request_id, None)

    def _drop_client(self, client_id: str) -> None:
        client = self.clients.pop(client_id, None)
        if client is not None:
            self.abort(list(client.request_ids))
