"""`background: true` on POST /v1/responses: the answer comes at once, as a `queued`
response, and the response is generated in this replica while clients poll
GET /v1/responses/{id}; POST /v1/responses/{id}/cancel cancels it from any replica.

The stored record (engine_actors/response_store.py) is the response's state: `queued`
when it is accepted, `in_progress` once its task runs, then as it ends (`completed`,
`incomplete`, or `failed` with its error). A cancel stores it as `cancelled` and ends its
engine requests, and this replica's own last update is then refused; if this replica
stops first, the scheduler stores it as `failed`. The work is not an HTTP request that
Serve sees: a replica that a scale-down stops fails what it runs.

With `stream: true` as well, the record also keeps the response's stream events as they
come. The POST's answer streams them from the record (stored_responses.StoredResponses
.stream), as GET /v1/responses/{id}?stream=true&starting_after=N does from any replica: a
client that loses its connection resumes after the last event it saw, and the response is
generated all the same.

A response that continues a conversation (`conversation`) adds its input and output items
to it as it ends completed or incomplete, before it is stored so (`on_end`: a client that
sees it ended continues from them), and releases its hold on it however it ends.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging

from deployments.protocol import APIError
from deployments.response_output import ResponseEvents, ResponseObject

logger = logging.getLogger("orca_serve.ingress")
INTERNAL_ERROR = "internal error"
GATHER_S = 0.02  # a stream's events are stored together when they come this close


class BackgroundResponses:
    def __init__(self, openai, stored):
        self.openai = openai  # OpenAIRoutes: collects the choices as a non-streamed request
        self.stored = stored  # StoredResponses
        self._tasks: set[asyncio.Task] = set()  # running, kept alive

    async def start(self, response: ResponseObject, items: list[dict], group, choices,
                    chat, timeout: float | None, events: ResponseEvents | None,
                    on_end=None) -> dict:
        """Store the submitted request's response as queued and run it; its body now.
        `events`: the stream's, for a streamed one; `on_end`: an async function called once,
        with its final body before it is stored completed or incomplete, else with None."""
        body = response.body("queued", [])
        owner = await self.openai.frontend.client.owner_id()  # (a reconnect: a new one)
        try:
            await self.stored.begin(body, items, owner, list(choices),
                                    [events.state("queued")] if events else [])
        except BaseException:
            group.close()  # its engine requests end, and a record stored all the same goes
            self._spawn(self.stored.delete_quietly(response.id))
            raise
        self._spawn(self._run(response, items, owner, group, choices, chat, timeout, events,
                              on_end))
        return body

    def _spawn(self, coro) -> None:
        """A task in a context of its own: Serve cancels the Ray calls made in a request's
        context when its client leaves (request_group.detached), and these outlive it."""
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """The replica stops: its runs end (the scheduler stores them as failed)."""
        for task in self._tasks:
            task.cancel()

    async def _run(self, response: ResponseObject, items: list[dict], owner: str, group,
                   choices, chat, timeout: float | None,
                   events: ResponseEvents | None, on_end=None) -> None:
        try:
            started = [events.state("in_progress")] if events else []
            if not await self.stored.update(response.body("in_progress", []), items, owner,
                                            True, started):
                group.close()  # cancelled or deleted while queued
                return
            last: list[dict] = []  # the stream's events not stored yet
            if events is not None:
                ended = await self._stream(response.id, owner, group, choices, chat, timeout,
                                           events)
                if ended is None:  # it runs here no more
                    group.close()
                    return
                body, last = ended
            else:
                try:
                    await self.openai.collect(group, choices, chat, timeout)
                    body = response.final(next(iter(choices.values())))
                except APIError as e:  # (OpenAI's codes: the cause is in the message)
                    body = response.body("failed", [], error={"code": "server_error",
                                                              "message": e.message})
            cut = any(c.finish_reason == "abort" for c in choices.values())  # (cancelled)
            if on_end is not None and body["status"] in ("completed", "incomplete") \
                    and not cut:
                await on_end(body)
                on_end = None
            if not await self.stored.update(body, items, owner, False, last):
                group.close()
        except Exception:  # (a stream's last event, response.failed, is the store's)
            logger.exception("background response %s failed", response.id)
            group.close()
            await self.stored.update(response.body("failed", [], error={
                "code": "server_error", "message": INTERNAL_ERROR}), items, owner, False, [])
        finally:
            if on_end is not None:  # (it failed, was cancelled, or runs here no more)
                await on_end(None)

    async def _stream(self, response_id: str, owner: str, group, choices, chat,
                      timeout: float | None, events: ResponseEvents
                      ) -> tuple[dict, list[dict]] | None:
        """Run the stream and store its events as they come, one call at a time: those that
        come within GATHER_S, or while a call is under way, go together. (Its final
        response, the events that end it), or None once it runs here no more (cancelled,
        deleted)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def produce():
            try:
                async for event in self.openai.stream_events(group, choices, events, chat,
                                                             timeout):
                    queue.put_nowait(event)
            except Exception:  # its end is still an event of the stream, numbered in turn
                logger.exception("background response %s failed", response_id)
                queue.put_nowait(events.error(INTERNAL_ERROR))
            finally:
                queue.put_nowait(None)
        producer = asyncio.get_running_loop().create_task(produce())
        try:
            while True:
                batch = [await queue.get()]
                if batch[0] is not None:
                    await asyncio.sleep(GATHER_S)
                while not queue.empty():
                    batch.append(queue.get_nowait())
                if batch[-1] is None:  # the end: it goes with the final state
                    return (events.final, batch[:-1]) if events.final else None
                if not await self.stored.add_events(response_id, owner, batch):
                    return None
        finally:
            producer.cancel()
