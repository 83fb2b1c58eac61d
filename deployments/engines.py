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

from deployments.engine_client import EngineClient, EngineUnavailable
from engine_actors.config import EngineConfig
from engine_actors.messages import EngineRequest

BALANCE = 8  # unfinished requests an engine may have beyond the least busy and keep a prefix
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

    @property
    def info(self):
        return self.clients[0].info

    @property
    def is_connected(self) -> bool:
        """Some engine serves (one that died is brought up again as requests come)."""
        return any(c.is_connected for c in self.clients)

    @property
    def client_id(self) -> str:
        """This replica's id at the first engine (the owner of its background responses)."""
        return self.clients[0].client_id

    async def connect(self):
        """Connect to every engine (those not connected); the model info."""
        infos = await asyncio.gather(*(c.connect() for c in self.clients))
        return infos[0]

    async def submit(self, requests: list[EngineRequest], wake_each_update: bool = True):
        """EngineClient.submit on the engine this HTTP request's choices go to."""
        return await self._route(requests[0]).submit(requests, wake_each_update)

    def _route(self, r: EngineRequest) -> EngineClient:
        if len(self.clients) == 1:
            return self.clients[0]
        if r.search is not None and r.search in self._searches:
            return self._searches[r.search]
        serving = self._serving()
        loads = {rank: self.clients[rank].num_unfinished for rank in serving}
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
        connected are brought up again meanwhile."""
        serving = [rank for rank, c in enumerate(self.clients) if c.is_connected]
        for rank, client in enumerate(self.clients):
            if not client.is_connected and rank not in self._reconnecting:
                self._reconnecting[rank] = asyncio.get_running_loop().create_task(
                    self._reconnect(rank), context=contextvars.Context())  # (no request's)
        return serving or list(range(len(self.clients)))

    async def _reconnect(self, rank: int) -> None:
        try:
            await self.clients[rank].connect()
        except Exception as e:  # the next request tries again
            logger.warning("engine %d is not back: %s", rank, e)
        finally:
            del self._reconnecting[rank]

    def end_search(self, search: str) -> None:
        self._searches.pop(search, self.clients[0]).end_search(search)

    async def call(self, method: str, *args):
        """A call on the engine that answers it: every engine for an adapter's load or
        unload (the first refusal) and /health (merged), those connected for a drain and
        /metrics (merged); else the first."""
        if len(self.clients) == 1:
            return await self.clients[0].call(method, *args)
        if method == "health":
            return merged_health(await asyncio.gather(*(c.call(method) for c in self.clients)))
        if method == "metrics_text":
            texts = await asyncio.gather(*(c.call(method) for c in self.clients
                                           if c.is_connected), return_exceptions=True)
            answered = [t for t in texts if not isinstance(t, BaseException)]
            if not answered:
                raise texts[0] if texts else EngineUnavailable("scheduler unavailable")
            return merged_metrics(answered)
        if method == "drain":
            await asyncio.gather(*(c.call(method, *args) for c in self.clients
                                   if c.is_connected))
            return None
        if method == "adapter_call" and args[0] in ("load", "unload"):
            results = await asyncio.gather(*(c.call(method, *args) for c in self.clients))
            return next((r for r in results if r is not None), None)
        return await self.clients[0].call(method, *args)

    async def stream_call(self, method: str, *args):  # (batch results: the first engine's)
        async for item in self.clients[0].stream_call(method, *args):
            yield item

    async def close(self, final: bool = True) -> None:
        await asyncio.gather(*(c.close(final) for c in self.clients))


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
    first = stats[0]
    blocks = sum(s.get("num_blocks", 0) for s in stats)
    merged = {**first, **{k: sum(s[k] for s in stats) for k in SUMMED
                          if all(k in s for s in stats)}}
    merged["state"] = next((s["state"] for s in stats if s["state"] != "ready"), "ready")
    merged["workers_alive"] = all(s["workers_alive"] for s in stats)
    if all("heartbeat_age_s" in s for s in stats):
        merged["heartbeat_age_s"] = max(s["heartbeat_age_s"] for s in stats)
    if blocks and all("kv_usage" in s for s in stats):
        merged["kv_usage"] = sum(s["kv_usage"] * s["num_blocks"] for s in stats) / blocks
    if all("prefix_cache_hit_rate" in s for s in stats):
        merged["prefix_cache_hit_rate"] = \
            sum(s["prefix_cache_hit_rate"] for s in stats) / len(stats)
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
