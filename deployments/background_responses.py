"""`background: true` on POST /v1/responses: the answer comes at once, as a `queued`
response, and the response is generated in this replica while clients poll
GET /v1/responses/{id}; POST /v1/responses/{id}/cancel cancels it from any replica.

The stored record (engine_actors/response_store.py) is the response's state: `queued`
when it is accepted, `in_progress` once its task runs, then as it ends (`completed`,
`incomplete`, or `failed` with its error). A cancel stores it as `cancelled` and ends its
engine requests, and this replica's own last update is then refused; if this replica
stops first, the scheduler stores it as `failed`. The work is not an HTTP request that
Serve sees: a replica that a scale-down stops fails what it runs.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging

from deployments.protocol import APIError
from deployments.response_output import ResponseObject

logger = logging.getLogger("orca_serve.ingress")


class BackgroundResponses:
    def __init__(self, openai, stored):
        self.openai = openai  # OpenAIRoutes: collects the choices as a non-streamed request
        self.stored = stored  # StoredResponses
        self._tasks: set[asyncio.Task] = set()  # running, kept alive

    async def start(self, response: ResponseObject, items: list[dict], group, choices,
                    chat, timeout: float | None) -> dict:
        """Store the submitted request's response as queued and run it; its body now."""
        body = response.body("queued", [])
        owner = self.openai.frontend.client.client_id  # (a reconnect makes a new one)
        try:
            await self.stored.begin(body, items, owner, list(choices))
        except BaseException:
            group.close()  # its engine requests end, and a record stored all the same goes
            self._spawn(self.stored.delete_quietly(response.id))
            raise
        self._spawn(self._run(response, items, owner, group, choices, chat, timeout))
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
                   choices, chat, timeout: float | None) -> None:
        try:
            if not await self.stored.update(response.body("in_progress", []), items, owner,
                                            True):
                group.close()  # cancelled or deleted while queued
                return
            try:
                await self.openai.collect(group, choices, chat, timeout)
                body = response.final(next(iter(choices.values())))
            except APIError as e:  # (OpenAI's codes: the cause is in the message)
                body = response.body("failed", [], error={"code": "server_error",
                                                          "message": e.message})
            if not await self.stored.update(body, items, owner, False):
                group.close()
        except Exception:
            logger.exception("background response %s failed", response.id)
            group.close()
            await self.stored.update(response.body("failed", [], error={
                "code": "server_error", "message": "internal error"}), items, owner, False)
