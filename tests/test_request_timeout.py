"""A request's time limit counts waiting for the engine, not writing to a slow client."""
from __future__ import annotations

import asyncio

import pytest

from deployments.openai_api import within


class Group:
    """Items that become ready `gap_s` apart."""

    def __init__(self, n: int, gap_s: float):
        self.left, self.gap_s = n, gap_s

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.left:
            raise StopAsyncIteration
        await asyncio.sleep(self.gap_s)
        self.left -= 1
        return self.left


def test_time_spent_writing_to_the_client_does_not_count():
    async def slow_client():
        got = []
        async for item in within(Group(5, 0.0), timeout_s=0.3):
            got.append(item)
            await asyncio.sleep(0.15)  # writing to a slow client: 0.75 s in all
        return got

    assert asyncio.run(slow_client()) == [4, 3, 2, 1, 0]


def test_waiting_for_the_engine_counts():
    async def run():
        async for _ in within(Group(5, 0.15), timeout_s=0.4):
            pass

    with pytest.raises(TimeoutError):
        asyncio.run(run())
