"""The caller's side of the scheduler actor's output stream (ingress, benchmarks, tests).

`OutputStream` opens a caller's `stream` call and yields `(request_id, RequestUpdate)` pairs
in order; `run_requests` submits requests in one call and follows them to their end.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from engine_actors.messages import EngineRequest, RequestUpdate


class OutputStream:
    """One caller's outputs. Open it before or after submitting with the same client_id:
    the actor keeps a caller's outputs until its stream reads them."""

    def __init__(self, actor, client_id: str | None = None, owner=None):
        self.actor = actor
        self.client_id = client_id or uuid.uuid4().hex
        self._calls = actor.stream.remote(self.client_id, owner)

    async def __aiter__(self) -> AsyncIterator[tuple[str, RequestUpdate]]:
        async for ref in self._calls:
            for request_id, item in (await ref).items():
                yield request_id, RequestUpdate.from_wire(item)

    def close(self) -> None:
        """End the stream call: the actor forgets this caller and aborts what is left."""
        import ray
        try:
            ray.cancel(self._calls)
        except Exception:  # the actor is gone already
            pass

    async def follow(self, unfinished: set[str],
                     on_update: Callable[[str, RequestUpdate], None]) -> None:
        """Pass every update to on_update until `unfinished` is empty (the caller may add
        to it or take from it meanwhile: later submissions, refusals)."""
        if not unfinished:
            return
        async for request_id, update in self:
            on_update(request_id, update)
            if update.finish_reason is not None:
                unfinished.discard(request_id)
                if not unfinished:
                    return

    async def submit(self, requests: list[EngineRequest]) -> None:
        """Queue requests for this caller; raises RuntimeError naming the first refusal."""
        refusals = await self.actor.add_requests.remote(self.client_id, requests)
        for r, refusal in zip(requests, refusals):
            if refusal is not None:
                raise RuntimeError(f"{r.request_id} refused: {refusal.code}: {refusal.message}")


async def run_requests(actor, requests: list[EngineRequest],
                       on_update: Callable[[str, RequestUpdate], None] | None = None
                       ) -> dict[str, RequestUpdate]:
    """Submit `requests` in one call and follow them until each has finished; returns each
    request's updates merged into one (all its tokens, its finish reason)."""
    stream = OutputStream(actor)
    results = {r.request_id: RequestUpdate() for r in requests}

    def merge(request_id: str, update: RequestUpdate) -> None:
        results[request_id].merge(update)
        if on_update is not None:
            on_update(request_id, update)
    try:
        await stream.submit(requests)
        await stream.follow(set(results), merge)
    finally:
        stream.close()
    return results
