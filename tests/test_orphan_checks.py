"""The scheduler actor's orphan checks: the engine outlives a redeploy's gap (no Ray)."""
import asyncio

import pytest

from engine_actors import scheduler_actor
from engine_actors.config import EngineConfig
from engine_actors.outbox import Outbox

GRACE_S = 0.4


@pytest.fixture
def actor(monkeypatch):
    monkeypatch.setattr(scheduler_actor, "ORPHAN_GRACE_S", GRACE_S)
    a = scheduler_actor.SchedulerActor(EngineConfig())
    a.teardowns = []

    async def teardown():
        a.teardowns.append(asyncio.get_running_loop().time())
    a._teardown = teardown
    return a


async def connect(a, client_id):
    """A replica opens its output stream; returns the task to cancel when it leaves."""
    task = asyncio.ensure_future(a.stream(client_id).__anext__())
    for _ in range(100):
        await asyncio.sleep(0.005)
        if client_id in a.outboxes:
            return task
    raise AssertionError("the stream never registered")


async def leave(task):
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_an_earlier_departure_does_not_end_a_later_redeploys_grace(actor):
    async def run():
        loop = asyncio.get_running_loop()
        actor.outboxes["old"] = Outbox("old")
        await actor.unregister("old", final=False)  # first redeploy: check 1 starts
        await asyncio.sleep(GRACE_S / 2)
        task = await connect(actor, "new")  # its successor connects ...
        await leave(task)  # ... and leaves: a second redeploy's gap begins
        left = loop.time()
        await asyncio.sleep(GRACE_S * 0.75)  # check 1 is due here, inside the new gap
        assert actor.teardowns == []
        await asyncio.sleep(GRACE_S)
        assert len(actor.teardowns) == 1  # the newest check still ends an orphaned engine
        assert actor.teardowns[0] - left >= GRACE_S
    asyncio.run(run())


def test_a_client_that_stays_keeps_the_engine(actor):
    async def run():
        actor.outboxes["old"] = Outbox("old")
        await actor.unregister("old", final=False)
        task = await connect(actor, "new")
        await asyncio.sleep(GRACE_S * 1.5)
        assert actor.teardowns == []
        await leave(task)
    asyncio.run(run())
