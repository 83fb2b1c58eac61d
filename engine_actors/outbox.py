"""Delivery of request outputs: one sink per kind of receiver.

Every request carries its sink (`Request.sink`). The scheduler actor hands each output to
it: an `Outbox` holds a caller's outputs until that caller's `stream` takes them (an
ingress replica, a benchmark, a test); a background batch keeps its results itself
(`engine_actors.batches.BatchState`). Both implement `Sink`.
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

from engine_actors.scheduler import RequestOutput


class Sink(Protocol):
    def deliver(self, out: RequestOutput, error: str | None) -> None:
        """New tokens of a request, maybe its last (then error says why it failed, if so)."""

    def aborted(self, out: RequestOutput) -> None:
        """The request was aborted on its owner's behalf (client gone, cancelled)."""


class Outbox:
    """Outputs waiting to be streamed to one caller, merged per request between reads: one
    stream item per iteration carries all of the caller's requests, each update in the wire
    form of RequestUpdate (a list; see RequestUpdate.from_wire)."""

    def __init__(self, client_id: str):
        self.client_id = client_id
        self.pending: dict[str, list] = {}
        self.request_ids: set[str] = set()  # unfinished requests of this caller
        self.event = asyncio.Event()

    def add(self, request_id: str) -> None:
        self.request_ids.add(request_id)

    def deliver(self, out: RequestOutput, error: str | None) -> None:
        error = error if out.finish_reason else None
        item = self.pending.get(out.request_id)
        if item is None:
            self.pending[out.request_id] = [out.new_token_ids, out.finish_reason,
                                            out.num_prompt_tokens, out.num_output_tokens, error,
                                            out.logprobs, out.prompt_logprobs,
                                            out.num_cached_tokens]
        else:
            item[0].extend(out.new_token_ids)
            item[1:5] = out.finish_reason, out.num_prompt_tokens, out.num_output_tokens, error
            item[7] = out.num_cached_tokens
            for i, more in ((5, out.logprobs), (6, out.prompt_logprobs)):
                if more:
                    item[i] = (item[i] or []) + more
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
                yield batch


async def _is_alive(actor, timeout_s: float) -> bool:
    import ray
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), timeout_s)
        return True
    except (ray.exceptions.ActorUnavailableError, asyncio.TimeoutError):
        return True  # restarting, or busy: not dead
    except ray.exceptions.RayActorError:
        return False
