"""The outputs of one HTTP request's engine requests, as its route reads them.

`EngineClient` (engine_client.py) routes each update of its output stream to the request's
group; the route iterates over the group until every request has finished, and closes it
however it ends (which aborts what is left).
"""
from __future__ import annotations

import asyncio
import contextvars
import time

from engine_actors.messages import RequestUpdate


class EngineUnavailable(RuntimeError):
    """The scheduler is starting, restarting or gone; worth retrying."""


class RequestGroup:
    """Outputs of a group of requests, as (request_id, RequestUpdate) pairs, until all have
    finished. Updates that arrive while the reader is busy are merged per request, so a
    reader that falls behind (a slow client) catches up with one larger chunk instead of one
    event per token. A reader that only needs each request's end (`wake_each_update=False`:
    a non-streamed response without stop strings) is woken once per request, not once per
    iteration; `arrivals` then keeps when its tokens came, for the latency metrics.
    `close()` aborts whatever has not finished (client gone, timeout); call it in a
    `finally`."""

    def __init__(self, routes: dict[str, RequestGroup], actor, request_ids: list[str],
                 wake_each_update: bool = True):
        """`routes`: where the output stream's reader looks up each request's group (the
        group adds its requests and removes each as it ends); `actor`: the scheduler."""
        self.routes, self.actor = routes, actor
        self.unfinished = set(request_ids)
        self.pending: dict[str, RequestUpdate] = {}  # not read yet, in arrival order
        self.ready = asyncio.Event()
        self.wake_each_update = wake_each_update
        self.arrivals: dict[str, list[tuple[float, int]]] = {}  # (time, tokens), deferred
        for rid in request_ids:
            routes[rid] = self

    def put(self, request_id: str, update: RequestUpdate) -> None:
        if not self.wake_each_update and update.token_ids:
            self.arrivals.setdefault(request_id, []).append(
                (time.monotonic(), len(update.token_ids)))
        earlier = self.pending.get(request_id)
        if earlier is None:
            self.pending[request_id] = update
        else:
            earlier.merge(update)
            earlier.unavailable |= update.unavailable
        if self.wake_each_update or update.finish_reason is not None:
            self.ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[str, RequestUpdate]:
        if not self.unfinished:
            raise StopAsyncIteration
        while (request_id := self._next_ready()) is None:
            self.ready.clear()
            await self.ready.wait()
        update = self.pending.pop(request_id)
        if update.unavailable:
            raise EngineUnavailable(update.error)
        if update.finish_reason is not None:
            self.unfinished.discard(request_id)
            self.routes.pop(request_id, None)
        return request_id, update

    def _next_ready(self) -> str | None:
        """The request whose update the reader gets next: the earliest pending one, or for
        a reader of ends only, the earliest that has ended."""
        for request_id, update in self.pending.items():
            if self.wake_each_update or update.finish_reason is not None:
                return request_id
        return None

    def finish(self, request_id: str) -> None:
        """A stop string matched: end the request in the scheduler (finish "stop")."""
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self.pending.pop(request_id, None)
            self.routes.pop(request_id, None)
            abort(self.actor, [request_id], stopped=True)

    def close(self) -> None:
        if self.unfinished:
            abort(self.actor, list(self.unfinished))
            for rid in self.unfinished:
                self.routes.pop(rid, None)
            self.unfinished.clear()


def detached(fn, *args, **kwargs):
    """`fn(*args)` outside the current request's Ray task. Serve cancels a request whose
    client left with `ray.cancel(recursive=True)`, which also cancels the Ray calls that
    request made, including ones it makes while it is being cancelled: without this, the
    abort sent from a cancelled handler's `finally` was sometimes dropped (a few streams in a
    thousand kept generating to their max_tokens), and a stream opened by the first request
    would die with it. Ray keeps the caller's task id in a context variable: a fresh context
    has none."""
    return contextvars.Context().run(fn, *args, **kwargs)




def abort(actor, request_ids: list[str], stopped: bool = False) -> None:
    """End requests in the scheduler (stopped: a stop string matched, finish "stop")."""
    try:
        detached(actor.abort.remote, request_ids, stopped)
    except Exception:  # the scheduler is gone, and with it the request
        pass
