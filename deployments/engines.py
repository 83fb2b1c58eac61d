"""Data parallelism: this replica's connections to the application's data_parallel_size
engines, behind one EngineClient's interface (deployments/engine_client.py).

Each request goes to the engine this replica last sent the longest prefix of its prompt
(whole KV blocks, of the same adapter and cache salt: that engine likely still holds them
in its prefix cache) when the prefix is at least half the prompt, unless that engine has
more than BALANCE unfinished requests of this replica beyond the least busy engine. Other
requests go to the least busy engine (in turn among equals). A beam search's steps stay on
its first step's engine.

The first engine keeps what the application stores (responses, conversations, batches) and
answers the calls that read it; adapters load and unload on every engine; /health and
/metrics cover every engine.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import time

from deployments.engine_client import (EngineClient, EngineFailed, EngineUnavailable,
                                       RequestRefused)
from engine_actors.config import EngineConfig
from engine_actors.messages import EngineRequest

BALANCE = 8  # unfinished requests an engine may have beyond the least busy and keep a prefix
RETRY_S = (1.0, 60.0)  # an engine that did not come back is tried again after 1 s, 2 s, ... 60 s
MAX_PREFIXES = 1 << 17  # prefix blocks remembered (about 20 MB), the oldest forgotten first
logger = logging.getLogger("orca_serve.ingress")
SUMMED = ("num_requests", "num_waiting", "num_running", "num_free_blocks",
          "num_blocks", "num_lent_blocks", "num_steps", "num_preemptions")


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
        return self.info

    async def submit(self, requests: list[EngineRequest], wake_each_update: bool = True):
        """EngineClient.submit on the engine this HTTP request's choices go to; refused
        there as the queue is full, on the least busy other one."""
        if len(self.clients) == 1:
            return await self.clients[0].submit(requests, wake_each_update)
        client, tried = self._route(requests[0]), set()
        while True:
            try:
                return await client.submit(requests, wake_each_update)
            except RequestRefused as e:
                tried.add(client.rank)
                others = [self.clients[r] for r in self._serving() if r not in tried]
                if e.code != "queue_full" or not others or requests[0].search is not None:
                    raise
                client = min(others, key=lambda c: c.num_unfinished)
            except EngineFailed as e:  # it could not start again: the others may serve
                raise EngineUnavailable(f"engine {client.rank}: {e}") from None

    def _route(self, r: EngineRequest) -> EngineClient:
        if r.search is not None and r.search in self._searches:
            return self._searches[r.search]
        loads = {rank: self.clients[rank].num_unfinished for rank in self._serving()}
        least = min(loads.values())
        hashes = self.prefixes.hashes(r)
        owner, matched = self.prefixes.match(hashes)
        if owner in loads and 2 * matched >= len(hashes) and loads[owner] <= least + BALANCE:
            rank = owner
        else:
            idle = [rank for rank, n in loads.items() if n == least]
            rank = idle[self._turn % len(idle)]
            self._turn += 1
        self.prefixes.record(hashes, rank)
        if r.search is not None:
            self._searches[r.search] = self.clients[rank]
        return self.clients[rank]

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
            return merged_health([_health(answers.get(c.rank)) for c in self.clients])
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
        if method == "adapter_call" and args[0] == "paths":  # those of every engine
            paths = await asyncio.gather(*(c.call(method, *args) for c in connected))
            return {name: path for p in paths for name, path in p.items()}
        return await (await self._first()).call(method, *args)

    async def stream_call(self, method: str, *args):  # (batch results: the first engine's)
        async for item in (await self._first()).stream_call(method, *args):
            yield item

    async def close(self, final: bool = True) -> None:
        self._closed = True
        for task in list(self._reconnecting.values()):
            task.cancel()
        await asyncio.gather(*(c.close(final) for c in self.clients))


def _health(reply) -> dict:
    """An engine's health, or why it has none (not connected: None; else the error)."""
    if isinstance(reply, dict):
        return reply
    reason = "not connected" if reply is None else f"{type(reply).__name__}: {reply}"
    return {"state": "unavailable", "workers_alive": False, "reason": reason}


class PrefixOwners:
    """The engine each prompt prefix of whole blocks went to last; the prefixes are chained
    hashes, one per block, and the least recently sent are forgotten first."""

    def __init__(self, block_size: int, capacity: int = MAX_PREFIXES):
        self.block_size, self.capacity = block_size, capacity
        self.owner: collections.OrderedDict[int, int] = collections.OrderedDict()

    def hashes(self, r: EngineRequest) -> list[int]:
        ids, size = r.prompt_token_ids, self.block_size
        h, out = hash((r.lora_name, r.cache_salt)), []  # (their KV is cached apart)
        for start in range(0, len(ids) - size + 1, size):
            h = hash((h, *ids[start:start + size]))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> tuple[int | None, int]:
        """The engine of the longest prefix known, and its number of blocks."""
        owner, n = None, 0
        for h in hashes:
            rank = self.owner.get(h)
            if rank is None:
                break
            owner, n = rank, n + 1
        return owner, n

    def record(self, hashes: list[int], rank: int) -> None:
        for h in hashes:
            self.owner[h] = rank
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)


def merged_health(stats: list[dict]) -> dict:
    """The engines' health in one: the first engine's (its stores), the counts summed, the
    state "ready" only if every engine's is, the oldest heartbeat; each engine's under
    `engines`."""
    def having(key: str) -> list[dict]:
        return [s for s in stats if key in s]

    merged = {**stats[0], **{k: sum(s[k] for s in having(k)) for k in SUMMED if having(k)}}
    merged["state"] = next((s["state"] for s in stats if s["state"] != "ready"), "ready")
    merged["workers_alive"] = all(s["workers_alive"] for s in stats)
    if having("heartbeat_age_s"):
        merged["heartbeat_age_s"] = max(s["heartbeat_age_s"] for s in having("heartbeat_age_s"))
    blocks = sum(s["num_blocks"] for s in having("num_blocks"))
    if blocks and having("kv_usage"):
        merged["kv_usage"] = sum(s["kv_usage"] * s["num_blocks"] for s in having("kv_usage")) \
            / blocks
    if having("prefix_cache_hit_rate"):
        rates = [s["prefix_cache_hit_rate"] for s in having("prefix_cache_hit_rate")]
        merged["prefix_cache_hit_rate"] = sum(rates) / len(rates)
    merged["data_parallel_size"] = len(stats)
    merged["engines"] = stats
    return merged


def merged_metrics(texts: list[bytes]) -> bytes:
    """Prometheus texts of registries with the same metrics (each engine's, told apart by
    their `engine` label) as one: each metric's HELP and TYPE once, then its samples."""
    families: dict[str, list[list[str]]] = {}  # name -> [header lines, sample lines]
    for text in texts:
        family = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP "):
                family = families.setdefault(line.split()[2], [[], []])
                if family[0]:
                    family = [[], family[1]]  # (its header is kept once)
            if family is None:
                continue
            family[0 if line.startswith("#") else 1].append(line)
    lines = [line for header, samples in families.values() for line in header + samples]
    return ("\n".join(lines) + "\n").encode()
