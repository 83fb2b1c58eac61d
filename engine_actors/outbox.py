"""Delivery of request outputs: one sink per kind of receiver.

Every request carries its sink (`Request.sink`). The scheduler actor hands each output to
it: an `Outbox` holds a caller's outputs until that caller's `stream` takes them (an
ingress replica, a benchmark, a test); a background batch keeps its results itself
(`engine_actors.batches.BatchState`). Both implement `Sink`.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol

from engine_actors.messages import RequestOutput, RequestUpdate


class Sink(Protocol):
    def deliver(self, out: RequestOutput, error: str | None) -> None:
        """New tokens of a request, maybe its last (then error says why it failed, if so)."""

    def aborted(self, out: RequestOutput) -> None:
        """The request was aborted on its owner's behalf (client gone, cancelled)."""


class Outbox:
    """Outputs waiting to be streamed to one caller, merged per request between reads: one
    stream item per iteration carries all of the caller's requests, each RequestUpdate in
    its wire form (RequestUpdate.to_wire)."""

    def __init__(self, client_id: str):
        self.client_id = client_id
        self.pending: dict[str, RequestUpdate] = {}
        self.request_ids: set[str] = set()  # unfinished requests of this caller
        self.searches: set[str] = set()  # its beam searches not ended (EngineRequest.search)
        self.ended = EarlyAborts()  # searches ended (an add Ray delivers late must not
        self.event = asyncio.Event()  # register one again)

    def add(self, request_id: str, search: str | None = None) -> None:
        self.request_ids.add(request_id)
        if search is not None and search not in self.ended.ids:
            self.searches.add(search)

    def end_search(self, search: str) -> None:
        self.searches.discard(search)
        self.ended.remember(search)

    def deliver(self, out: RequestOutput, error: str | None) -> None:
        update = RequestUpdate(out.new_token_ids, out.finish_reason, out.num_prompt_tokens,
                               out.num_output_tokens, error if out.finish_reason else None,
                               out.logprobs, out.prompt_logprobs, out.num_cached_tokens,
                               out.embedding)
        earlier = self.pending.get(out.request_id)
        if earlier is None:
            self.pending[out.request_id] = update
        else:
            earlier.merge(update)
        if out.finish_reason is not None:
            self.request_ids.discard(out.request_id)
        self.event.set()

    def aborted(self, out: RequestOutput) -> None:
        """The caller aborted it itself: it expects nothing more."""
        self.request_ids.discard(out.request_id)
        self.pending.pop(out.request_id, None)

    async def stream(self, owner, check_every_s: float):
        """Everything pending, whenever there is some, until `owner` (an actor handle, or
        None) is found dead."""
        last_check = time.monotonic()
        while True:
            try:
                await asyncio.wait_for(self.event.wait(), check_every_s)
            except asyncio.TimeoutError:
                pass
            self.event.clear()
            if owner is not None and time.monotonic() - last_check > check_every_s:
                last_check = time.monotonic()
                if not await _is_alive(owner, check_every_s):
                    return
            batch, self.pending = self.pending, {}
            if batch:
                yield {rid: update.to_wire() for rid, update in batch.items()}


class EarlyAborts:
    """Aborts that arrive before their requests' add_requests (Ray may reorder calls of
    different tasks; adds wait for the engine to start): remembered, at most `limit`."""

    def __init__(self, limit: int = 4096):
        self.ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.limit = limit

    def remember(self, request_id: str) -> None:
        self.ids[request_id] = None
        while len(self.ids) > self.limit:
            self.ids.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """Was request_id aborted before it came? (It is forgotten.)"""
        return self.ids.pop(request_id, 0) is None


async def _is_alive(actor, timeout_s: float) -> bool:
    import ray
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), timeout_s)
        return True
    except (ray.exceptions.ActorUnavailableError, asyncio.TimeoutError):
        return True  # restarting, or busy: not dead
    except ray.exceptions.RayActorError:
        return False
