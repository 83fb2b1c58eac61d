"""The ingress replica's side of the scheduler actor.

Gets or creates the named scheduler actor, keeps one output stream open to it, and hands
each request's outputs to its RequestGroup (deployments/request_group.py). If the scheduler
dies, every waiting request gets an error at once and the next request brings a new
scheduler up.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid

import ray

from deployments.request_group import EngineUnavailable, RequestGroup, detached
from engine_actors.checkpoint import ModelInfo
from engine_actors.config import EngineConfig
from engine_actors.messages import EngineRequest, Refusal, RequestUpdate
from engine_actors.output_stream import OutputStream
from engine_actors.scheduler_actor import NAMESPACE, SchedulerActor, actor_name

__all__ = ["EngineClient", "EngineFailed", "EngineUnavailable", "RequestGroup",
           "RequestRefused", "detached"]

logger = logging.getLogger("orca_serve.ingress")


def scheduler_actor(cfg: EngineConfig, rank: int = 0):
    """The scheduler actor of the application's engine `rank`: created on first call, found
    by name after that (detached: it outlives whoever created it, and goes when no replica
    is left)."""
    return ray.remote(SchedulerActor).options(
        name=actor_name(cfg, rank), namespace=NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=10_000,
        # like Serve's own actors: calls per iteration and per request each left a task
        # event in the GCS (its memory grew by 160 MB in a 10-minute soak)
        enable_task_events=False,
    ).remote(cfg, time.time(), rank)


def start_engine_early(cfg: EngineConfig) -> None:
    """Start the engine while Serve is still starting the ingress replicas (called when the
    application is built): the workers load the weights meanwhile, instead of after a
    replica is up. The replicas then find the actor by name, and a start failure reaches
    them through ready(). Does nothing outside a Ray job."""
    if ray.is_initialized():
        for rank in range(cfg.data_parallel_size):
            scheduler_actor(cfg, rank)  # the actor starts its engine as it is created


class EngineFailed(RuntimeError):
    """The engine could not start (the message says why); retrying would fail again."""


class RequestRefused(ValueError):
    """The scheduler refused the request (see messages.Refusal for the codes)."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.code = refusal.code


def _own_actor():
    """This replica's actor handle, so the scheduler can tell when it dies (None off-actor)."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


class EngineClient:
    """This replica's connection to one engine (`rank` of data_parallel_size)."""

    def __init__(self, cfg: EngineConfig, rank: int = 0):
        self.cfg, self.rank = cfg, rank
        self.client_id = uuid.uuid4().hex
        self.info: ModelInfo | None = None
        self._actor = None
        self._groups: dict[str, RequestGroup] = {}  # of each unfinished request
        self._lock: asyncio.Lock | None = None
        self._stream_task: asyncio.Task | None = None
        self._adds: list[tuple[list[EngineRequest], asyncio.Future]] = []  # not sent yet
        self._is_adding = False  # an add_requests call is in flight

    @property
    def is_connected(self) -> bool:
        return self._actor is not None

    @property
    def num_unfinished(self) -> int:
        """This replica's requests on the engine that have not finished."""
        return len(self._groups)

    async def connect(self) -> ModelInfo:
        """Get or create the scheduler and wait until its workers are ready."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._actor is None:
                # a fresh id per connection: a stale stream of an earlier one can not
                # steal (or drop, when it ends) this connection's outputs
                self.client_id = uuid.uuid4().hex
                actor = scheduler_actor(self.cfg, self.rank)
                try:
                    self.info = await actor.ready.remote()
                except ray.exceptions.RayActorError:
                    raise EngineUnavailable("scheduler unavailable") from None
                except ray.exceptions.RayTaskError as e:  # start failed: say why, no traceback
                    raise EngineFailed(str(getattr(e, "cause", None) or e)) from None
                self._actor = actor
                stream = detached(OutputStream, actor, self.client_id, _own_actor())
                self._stream_task = asyncio.get_running_loop().create_task(
                    self._consume(actor, stream), context=contextvars.Context())
        return self.info

    async def _consume(self, actor, stream: OutputStream) -> None:
        """Route the scheduler's output stream into per-request queues."""
        reason = "scheduler stream ended"
        try:
            async for request_id, update in stream:
                group = self._groups.get(request_id)
                if group is not None:
                    group.put(request_id, update)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"scheduler failed: {type(e).__name__}"
            logger.warning("scheduler stream broke: %s", e)
        if self._actor is actor:
            self._actor = None
        for request_id, group in list(self._groups.items()):
            group.put(request_id, RequestUpdate(finish_reason="abort", error=reason,
                                                unavailable=True))

    async def submit(self, requests: list[EngineRequest],
                     wake_each_update: bool = True) -> RequestGroup:
        """Queue requests (the choices of one HTTP request); returns their joint output
        stream (see RequestGroup for `wake_each_update`). Raises RequestRefused, with
        nothing left queued, if the scheduler refuses any of them. Submissions go to the
        scheduler together: those of one event-loop tick, and all those made while the
        previous add_requests call was in flight, in one call (a burst of HTTP requests
        costs a few Ray calls, not one each)."""
        actor = await self._connected_actor()
        group = RequestGroup(self._groups, actor, [r.request_id for r in requests],
                             wake_each_update)
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        if not self._adds and not self._is_adding:
            loop.call_soon(self._send_adds, actor)
        self._adds.append((requests, result))
        try:
            refusals = await result
        except ray.exceptions.RayActorError:
            group.close()
            raise EngineUnavailable("scheduler unavailable") from None
        except BaseException:
            group.close()
            raise
        refusal = next((r for r in refusals if r is not None), None)
        if refusal is not None:
            group.close()
            raise RequestRefused(refusal)
        return group

    def _send_adds(self, actor) -> None:
        """One add_requests call for the submissions waiting, made outside any of their
        request tasks (see detached): one client leaving must not cancel the others' call."""
        batch, self._adds = self._adds, []
        if not batch:
            return
        self._is_adding = True
        ref = detached(actor.add_requests.remote, self.client_id,
                       [r for requests, _ in batch for r in requests])
        asyncio.get_running_loop().create_task(self._added(ref, batch, actor),
                                               context=contextvars.Context())

    async def _added(self, ref, batch, actor) -> None:
        try:
            await _split_result(ref, batch)
        finally:
            self._is_adding = False
            self._send_adds(actor)  # what arrived meanwhile

    def end_search(self, search: str) -> None:
        """A beam search of this replica is over (EngineRequest.search)."""
        if self._actor is not None:
            try:
                detached(self._actor.end_search.remote, self.client_id, search)
            except Exception:  # the scheduler is gone, and with it the search
                pass

    async def _connected_actor(self):
        """The scheduler actor, connecting first; EngineUnavailable if it is gone."""
        await self.connect()
        if self._actor is None:
            raise EngineUnavailable("scheduler unavailable")
        return self._actor

    async def call(self, method: str, *args):
        """A plain call on the scheduler (batches, health), EngineUnavailable if it is gone."""
        actor = await self._connected_actor()
        try:
            return await getattr(actor, method).remote(*args)
        except ray.exceptions.RayActorError:
            raise EngineUnavailable("scheduler unavailable") from None

    async def stream_call(self, method: str, *args):
        """Items of a streaming call on the scheduler."""
        actor = await self._connected_actor()
        try:
            async for ref in getattr(actor, method).remote(*args):
                yield await ref
        except ray.exceptions.RayActorError:
            raise EngineUnavailable("scheduler unavailable") from None

    async def close(self, final: bool = True) -> None:
        """This replica is going away: tell the scheduler (the last one tears it down, at
        once when final: the application is being deleted)."""
        if self._stream_task is not None:
            self._stream_task.cancel()
        actor, self._actor = self._actor, None
        if actor is None:  # maybe still starting: it must not outlive the application
            try:
                actor = ray.get_actor(actor_name(self.cfg, self.rank), namespace=NAMESPACE)
            except ValueError:
                return
        try:
            await asyncio.wait_for(actor.unregister.remote(self.client_id, final), timeout=10)
        except Exception:  # the scheduler is gone already, or tearing down
            pass


async def _split_result(ref, batch: list[tuple[list, asyncio.Future]]) -> None:
    """Hand each submission its part of a joint add_requests answer (or its failure)."""
    try:
        refusals = await ref
    except BaseException as e:  # the scheduler died, or this task was cancelled
        for _, result in batch:
            if not result.done():
                result.set_exception(e if isinstance(e, Exception) else
                                     EngineUnavailable("scheduler unavailable"))
        return
    start = 0
    for requests, result in batch:
        if not result.done():
            result.set_result(refusals[start:start + len(requests)])
        start += len(requests)
