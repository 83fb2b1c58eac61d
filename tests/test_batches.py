"""Background batch state in the scheduler actor, without Ray (the actor class is plain)."""
from __future__ import annotations

import asyncio

from engine_actors.batches import BatchState
from engine_actors.config import EngineConfig
from engine_actors.scheduler_actor import SchedulerActor


def test_every_reader_of_batch_results_sees_every_result():
    """Two readers; one is busy when the last result lands: neither may miss it."""
    actor = SchedulerActor(EngineConfig())

    async def scenario():
        state = actor.batches["b"] = BatchState("b", 2)
        seen = {"fast": [], "slow": []}

        async def read(name, pause):
            async for results in actor.batch_results("b"):
                seen[name] += [r["index"] for r in results]
                await asyncio.sleep(pause)  # "busy at yield"

        readers = [asyncio.create_task(read("fast", 0.0)),
                   asyncio.create_task(read("slow", 0.05))]
        await asyncio.sleep(0.01)
        state.add_output(0, [1, 2], "length", 3)
        await asyncio.sleep(0.01)  # the slow reader is still busy with result 0
        state.add_output(1, [4], None, 3)
        state.add_output(1, [5], "stop", 3)
        await asyncio.wait_for(asyncio.gather(*readers), timeout=2)
        return seen

    seen = asyncio.run(scenario())
    assert sorted(seen["fast"]) == [0, 1] and sorted(seen["slow"]) == [0, 1]


def test_batch_status_counts_and_tokens():
    state = BatchState("b", 3)
    state.add_output(0, [7, 8], "length", 2)
    state.add_output(1, [], "abort", 2, "cancelled")
    assert state.status()["status"] == "in_progress"
    state.add_output(2, [9], "stop", 2, None)
    status = state.status()
    assert (status["status"], status["num_completed"], status["num_cancelled"],
            status["num_failed"]) == ("completed", 2, 1, 0)
    assert state.result(0)["token_ids"] == [7, 8]
