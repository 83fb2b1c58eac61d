"""A streaming response aborts its requests however it ends, even before the first byte."""
from __future__ import annotations

import asyncio

from deployments.responses import SSEResponse


def test_client_gone_before_the_body_starts_still_closes_the_group():
    closed = []

    async def body():
        await asyncio.sleep(10)  # never reached: the client is already gone
        yield "data: x\\n\\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("client went away")

    async def run():
        response = SSEResponse(body(), on_close=lambda: closed.append(True))
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST"}
        try:
            await asyncio.wait_for(response(scope, receive, send), timeout=5)
        except Exception:
            pass

    asyncio.run(run())
    assert closed == [True]
