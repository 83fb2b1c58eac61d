"""`background: true` on POST /v1/responses: the answer comes at once, as a `queued`
response, and the response is generated in this replica while clients poll
GET /v1/responses/{id}; POST /v1/responses/{id}/cancel cancels it from any replica.

The stored record (engine_actors/response_store.py) is the response's state: `queued`
when it is accepted, `in_progress` once its task runs, then as it ends (`completed`,
`incomplete`, or `failed` with its error). A cancel stores it as `cancelled` and ends its
engine requests, and this replica's own last update is then refused; if this replica
stops first, the scheduler stores it as `failed`.
"""
from __future__ import annotations

import asyncio
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
        try:
            await self.stored.begin(body, items, list(choices))
        except BaseException:
            group.close()  # (its engine requests end)
            raise
        task = asyncio.get_running_loop().create_task(
            self._run(response, items, group, choices, chat, timeout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return body

    async def _run(self, response: ResponseObject, items: list[dict], group, choices, chat,
                   timeout: float | None) -> None:
        try:
            if not await self.stored.update(response.body("in_progress", []), items, True):
                return group.close()  # cancelled or deleted while queued
            try:
                await self.openai.collect(group, choices, chat, timeout)
                body = response.final(next(iter(choices.values())))
            except APIError as e:
                body = response.body("failed", [], error={"code": e.code or "server_error",
                                                          "message": e.message})
            await self.stored.update(body, items, False)
        except Exception:
            logger.exception("background response %s failed", response.id)
            group.close()
            await self.stored.update(response.body("failed", [], error={
                "code": "server_error", "message": "internal error"}), items, False)
