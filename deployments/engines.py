"""Data parallelism: this replica's connections to the application's data_parallel_size
engines, behind one EngineClient's interface (deployments/engine_client.py).

Each request goes to the engine that got the longest earlier prompt its prompt begins with
(whole KV blocks, of the same adapter and cache salt: that engine likely still holds them
in its prefix cache), unless that engine has more than BALANCE unfinished requests of this
replica beyond the least busy engine. Only whole prompts are remembered: prompts that share
a system prompt alone do not follow each other. Other requests go to the least busy engine
(in turn among equals). The replicas share their routes every SHARE_S through the first
engine. A beam search's steps stay on its first step's engine.

A batch is shared out over the engines. The first engine keeps what the application stores
(responses, conversations) and answers the calls that read it; adapters load and unload on
every engine; /health and /metrics cover every engine (deployments/merged_replies.py).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid

from deployments.engine_client import (EngineClient, EngineFailed, EngineUnavailable,
                                       RequestRefused)
from deployments.merged_replies import (engine_health, merged_batch_status, merged_health,
                                        merged_metrics, merged_streams)
from deployments.prefix_routes import PrefixOwners
from engine_actors.config import EngineConfig
from engine_actors.messages import EngineRequest, Refusal

BALANCE = 8  # unfinished requests an engine may have beyond the least busy and keep a prefix
RETRY_S = (1.0, 60.0)  # an engine that did not come back is tried again after 1 s, 2 s, ... 60 s
SHARE_S = 0.5  # how often a replica shares its routes with the others (through engine 0)
logger = logging.getLogger("orca_serve.ingress")


class Engines:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.clients = [EngineClient(cfg, rank) for rank in range(cfg.data_parallel_size)]
        self.prefixes = PrefixOwners(cfg.block_size)
        self._searches: dict[str, EngineClient] = {}  # a beam search's engine
        self._turn = 0  # among equally busy engines, the next one to take a request
        self._reconnecting: dict[int, asyncio.Task] = {}
        self._retry = [(0.0, RETRY_S[0])] * len(self.clients)  # (next try at, then wait)
        self._closed = False
        self._sharing: asyncio.Task | None = None  # the routes shared with other replicas
        self._replica, self._shared = uuid.uuid4().hex, (None, 0)  # (the log's, its last)

    @property
    def info(self):
        """The model info; its max_model_len the least of the engines' (each sizes its own
        KV cache)."""
        infos = [c.info for c in self.clients if c.info is not None]
        return min(infos, key=lambda i: i.max_model_len) if infos else None

    @property
    def is_connected(self) -> bool:
        """Some engine serves (one that died is brought up again meanwhile)."""
        return any(c.is_connected for c in self.clients)

    async def owner_id(self) -> str:
        """This replica's id at the first engine, where its background responses are kept
        (connected first: the id of a connection that broke would never be told gone)."""
        return (await self._first()).client_id

    async def connect(self):
        """Connect to every engine (those not connected); the model info."""
        await asyncio.gather(*(c.connect() for c in self.clients))
        self._start_sharing()
        return self.info

    async def submit(self, requests: list[EngineRequest], wake_each_update: bool = True):
        """EngineClient.submit on the engine this HTTP request's choices go to; refused
        there as the queue is full, on the least busy other one."""
        if len(self.clients) == 1:
            return await self.clients[0].submit(requests, wake_each_update)
        r = requests[0]
        hashes = self.prefixes.hashes(r) if r.search is None else []
        client, tried = self._route(r, hashes), set()
        while True:
            try:
                group = await client.submit(requests, wake_each_update)
            except RequestRefused as e:
                tried.add(client.rank)
                others = [self.clients[rank] for rank in self._serving() if rank not in tried]
                if e.code != "queue_full" or not others or r.search is not None:
                    raise
                client = min(others, key=lambda c: c.num_unfinished)
            except EngineFailed as e:  # it could not start again: the others may serve
                raise EngineUnavailable(f"engine {client.rank}: {e}") from None
            else:  # (where it was taken, not where it was first sent)
                if r.search is not None:
                    self._searches[r.search] = client
                elif not r.continues:
                    self.prefixes.record(hashes, client.rank)
                return group

    def _route(self, r: EngineRequest, hashes: list[int]) -> EngineClient:
        self._start_sharing()
        if r.search is not None and r.search in self._searches:
            return self._searches[r.search]
        loads = {rank: self.clients[rank].num_unfinished for rank in self._serving()}
        least = min(loads.values())
        owner = self.prefixes.match(hashes)
        if owner in loads and loads[owner] <= least + BALANCE:
            return self.clients[owner]
        idle = [rank for rank, n in loads.items() if n == least]
        self._turn += 1
        return self.clients[idle[self._turn % len(idle)]]

    def _start_sharing(self) -> None:
        if len(self.clients) > 1 and self._sharing is None and not self._closed:
            self._sharing = asyncio.get_running_loop().create_task(
                self._share_routes(), context=contextvars.Context())

    async def _share_routes(self) -> None:
        """Every SHARE_S: hand the first engine the routes this replica took since, and
        learn those the other replicas took (engine_actors/prefix_log.py), in the log's
        order (the same prompt routed by two replicas ends on the same engine in both)."""
        failing = False
        while True:
            await asyncio.sleep(SHARE_S)
            if not self.clients[0].is_connected:
                continue
            entries, self.prefixes.recent = self.prefixes.recent, []
            try:
                log, seq, news = await self.clients[0].call(
                    "share_prefixes", self._replica, entries, *self._shared)
                self._shared, failing = (log, seq), False
            except Exception as e:  # the first engine is away: the next round shares them
                self.prefixes.recent[:0] = entries
                if not failing:
                    logger.warning("routes not shared with the other replicas: %s", e)
                failing = True
                continue
            for routes in (news, entries, self.prefixes.recent):
                self.prefixes.learn(routes)

    def _serving(self) -> list[int]:
        """The engines connected (all when none is: the request waits for them); those not
        connected are brought up again meanwhile, after a failed try at growing intervals."""
        now = time.monotonic()
        for rank, client in enumerate(self.clients):
            if not client.is_connected and now >= self._retry[rank][0]:
                self._reconnect(rank)
        return [rank for rank, c in enumerate(self.clients) if c.is_connected] or \
            list(range(len(self.clients)))

    def _reconnect(self, rank: int) -> asyncio.Task:
        """The task bringing engine `rank` up again (started if none runs)."""
        if rank not in self._reconnecting and not self._closed:
            self._reconnecting[rank] = asyncio.get_running_loop().create_task(
                self._reconnected(rank), context=contextvars.Context())  # (no request's)
        return self._reconnecting.get(rank) or asyncio.sleep(0)

    async def _reconnected(self, rank: int) -> None:
        try:
            await self.clients[rank].connect()
            self._retry[rank] = (0.0, RETRY_S[0])
            await self._restore_adapters(rank)
        except Exception as e:  # a later request tries again
            wait = self._retry[rank][1]
            self._retry[rank] = (time.monotonic() + wait, min(2 * wait, RETRY_S[1]))
            logger.warning("engine %d is not back (next try in %.0f s): %s", rank, wait, e)
        finally:
            del self._reconnecting[rank]

    async def _restore_adapters(self, rank: int) -> None:
        """Load on an engine that came back the adapters another engine has (loaded at run
        time: a new engine has only lora_modules)."""
        source = next((c for c in self.clients if c.rank != rank and c.is_connected), None)
        if not self.cfg.lora_enabled or source is None:
            return
        target = self.clients[rank]
        have = await target.call("adapter_call", "paths")
        for name, path in (await source.call("adapter_call", "paths")).items():
            if name not in have:
                await target.call("adapter_call", "load", name, path)

    async def _first(self) -> EngineClient:
        """The first engine (brought up again first if it died)."""
        if len(self.clients) > 1 and not self.clients[0].is_connected:
            await asyncio.shield(self._reconnect(0))
        return self.clients[0]

    def end_search(self, search: str) -> None:
        self._searches.pop(search, self.clients[0]).end_search(search)

    async def call(self, method: str, *args):
        """A call on the engine that answers it: the engines connected for a drain, an
        adapter's load or unload (the first refusal; one that comes back gets them) and
        /health and /metrics (merged); else the first."""
        if len(self.clients) == 1:
            return await self.clients[0].call(method, *args)
        try:
            return await self._call(method, *args)
        except EngineFailed as e:  # it could not start again: the others may serve
            raise EngineUnavailable(str(e)) from None

    async def _call(self, method: str, *args):
        connected = [c for c in self.clients if c.is_connected]
        if method == "health":
            self._serving()  # (an engine that is not connected is brought up again)
            replies = await asyncio.gather(*(c.call(method) for c in connected),
                                           return_exceptions=True)
            answers = dict(zip((c.rank for c in connected), replies))
            return merged_health([engine_health(answers.get(c.rank)) for c in self.clients])
        if method == "metrics_text":
            texts = await asyncio.gather(*(c.call(method) for c in connected),
                                         return_exceptions=True)
            answered = [t for t in texts if not isinstance(t, BaseException)]
            if not answered:
                raise texts[0] if texts else EngineUnavailable("scheduler unavailable")
            return merged_metrics(answered)
        if method == "drain" or (method == "adapter_call" and args[0] in ("load", "unload")):
            results = await asyncio.gather(*(c.call(method, *args) for c in connected))
            return next((r for r in results if r is not None), None)
        if method in ("submit_batch", "batch_call"):
            self._serving()  # (an engine that is not connected is brought up again)
            if not connected:
                raise EngineUnavailable("no engine is connected")
        if method == "submit_batch":
            return await self._submit_batch(connected, *args)
        if method == "batch_call":  # (status, cancel) of every engine's share
            replies = await asyncio.gather(*(c.call(method, *args) for c in connected),
                                           return_exceptions=True)
            answered = [r for r in replies if not isinstance(r, BaseException)]
            if not answered:
                raise replies[0]
            return merged_batch_status([r for r in answered if r is not None])
        if method == "adapter_call" and args[0] == "paths":  # those of every engine
            paths = await asyncio.gather(*(c.call(method, *args) for c in connected))
            return {name: path for p in paths for name, path in p.items()}
        return await (await self._first()).call(method, *args)

    async def _submit_batch(self, connected: list[EngineClient], batch_id: str,
                            requests: list, priority: int = 1):
        """A batch in one share per engine (consecutive requests, the first share on the
        next engine in turn), or none: the first refusal, every other share cancelled."""
        self._turn += 1
        engines = connected[self._turn % len(connected):] + connected[:self._turn % len(connected)]
        n, total = len(engines), len(requests)
        bounds = [-(-total * k // n) for k in range(n + 1)]  # (the larger shares first)
        shares = [(c, bounds[k], bounds[k + 1]) for k, c in enumerate(engines)
                  if bounds[k + 1] > bounds[k]]
        refusals = await asyncio.gather(*(
            c.call("submit_batch", batch_id, requests[first:end], priority, first, total)
            for c, first, end in shares), return_exceptions=True)
        failure = next((r for r in refusals if r is not None), None)
        if failure is not None:  # (a share whose call failed may have been queued)
            await asyncio.gather(*(c.call("batch_call", "cancel", batch_id)
                                   for (c, _, _), r in zip(shares, refusals)
                                   if not isinstance(r, Refusal)), return_exceptions=True)
            if isinstance(failure, BaseException):
                raise failure
        return failure

    async def stream_call(self, method: str, *args):
        """Batch results (lists of BatchResult): every engine's share, as they come; an
        error at the end if a share is missing (its engine stopped since)."""
        if len(self.clients) == 1:
            async for item in self.clients[0].stream_call(method, *args):
                yield item
            return
        status = await self.call("batch_call", "status", *args)
        got = 0
        try:
            async for results in merged_streams([c.stream_call(method, *args)
                                                 for c in self.clients if c.is_connected]):
                got += len(results)
                yield results
        except EngineFailed as e:
            raise EngineUnavailable(str(e)) from None
        if status is not None and got < status["num_requests"]:
            raise EngineUnavailable(f"{status['num_requests'] - got} results were lost with "
                                    "the engine that ran them")

    async def close(self, final: bool = True) -> None:
        self._closed = True
        for task in [*self._reconnecting.values(), *filter(None, [self._sharing])]:
            task.cancel()
        await asyncio.gather(*(c.close(final) for c in self.clients))
