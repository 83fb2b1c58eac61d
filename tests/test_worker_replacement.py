"""After a worker fails, the group is rebuilt with an empty KV pool and no adapter loaded:
the scheduler must not believe otherwise. Through the engine loop, with stand-in workers
that keep what real ones keep (tests/fake_runner.py) and lose it when they are replaced."""
from __future__ import annotations

import asyncio

import ray

from engine_actors.checkpoint import ModelInfo
from engine_actors.config import EngineConfig
from engine_actors.engine_loop import EngineLoop
from engine_actors.lora_files import AdapterInfo
from engine_actors.messages import EngineRequest
from engine_actors.metrics import EngineMetrics
from engine_actors.request import SamplingParams
from engine_actors.scheduler import Scheduler
from tests.fake_runner import FakeRunner, expected_output
from tests.test_deferral import until

PROMPT = list(range(1, 18))  # four full blocks of 4, cached once a request ends


class Workers:
    """Fails the next step when told to; replaced, it holds no KV and no adapter."""

    def __init__(self):
        self.runner, self.loaded, self.fail_next = FakeRunner(4), set(), False

    async def execute(self, step):
        await asyncio.sleep(0.001)
        if self.fail_next:
            self.fail_next = False
            raise ray.exceptions.RayError("a worker died")
        self.loaded |= {slot for slot, _, _ in step.lora_loads}
        assert all(r.lora_slot in self.loaded for r in step.new_requests if r.lora_slot >= 0), \
            "an adapter slot used that these workers never loaded"
        return self.runner.execute(step)


def engine(**args):
    cfg = EngineConfig(block_size=4, max_num_tokens=256, max_batch_size=8, **args)
    outputs, ends = {}, {}

    def deliver(outs, error):
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                ends[o.request_id] = (o.finish_reason, error)

    workers = Workers()
    loop = EngineLoop(cfg, ModelInfo("m", "", 512, (0,), 256), workers,
                      Scheduler.from_config(cfg, 64, 512, (0,)), EngineMetrics("m"), deliver)

    async def restart():  # new workers
        workers.runner, workers.loaded = FakeRunner(4), set()

    loop._restart_workers = restart
    return loop, workers, outputs, ends


def request(rid, prompt, tokens=4):
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                     ignore_eos=True))


def run_around_a_failure(loop, workers, ends, before, after, lora=None):
    """`before` ends; a request fails with the workers; `after` runs on the new ones."""
    async def run():
        task = asyncio.create_task(loop.run())
        try:
            loop.add(before, None, lora)
            await until(lambda: before.request_id in ends)
            workers.fail_next = True
            loop.add(request("fails", [50] * 9), None, None)
            await until(lambda: "fails" in ends)
            loop.add(after, None, lora)
            await until(lambda: after.request_id in ends or task.done())
            assert not task.done()
        finally:
            task.cancel()
    asyncio.run(run())


def test_the_prefix_cache_forgets_blocks_whose_kv_the_failed_workers_held():
    loop, workers, outputs, ends = engine()
    run_around_a_failure(loop, workers, ends, request("a", PROMPT), request("c", PROMPT))
    assert ends["fails"][0] == "abort"
    assert ends["c"] == ("length", None)
    assert outputs["c"] == expected_output(PROMPT, 4)  # computed again, not read from the cache


def test_adapters_are_loaded_again_on_the_new_workers():
    loop, workers, outputs, ends = engine(enable_lora=True)
    adapter = AdapterInfo("x", "/adapters/x", 2, 1.0, ("q_proj",), 1)
    run_around_a_failure(loop, workers, ends, request("a", [7] * 6), request("c", [9] * 6),
                         lora=adapter)
    assert ends["c"] == ("length", None)
