"""The real engine as the simulator's reference: the scheduler actor (and its worker actor)
in a local Ray instance, fed by an asyncio driver.

Used by the calibration (the control-plane cost of an iteration, which in-process step
timings cannot see) and by the simulator's validation (the same trace through the real
engine and through the simulator). Requests carry `ignore_eos` and greedy sampling, so each
generates exactly max_tokens and the cost is that of the cheapest sampler path, as in the
calibration steps.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass

from load_tests.traces import TraceRequest


@dataclass(slots=True)
class EngineOutcome:
    """One request as the driver saw it; times in seconds since the replay's start."""
    submit_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    num_generated: int = 0
    refusal: str | None = None


def _sampling(max_tokens: int):
    from engine_actors.request import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class LocalEngine:
    """`with LocalEngine(engine_args) as actor:` a started scheduler actor in a fresh local
    Ray instance; leaving the block shuts the engine and Ray down."""

    def __init__(self, engine_args: dict):
        self.engine_args = engine_args
        self.actor = None

    def __enter__(self):
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray

        from engine_actors.config import EngineConfig
        from engine_actors.scheduler_actor import SchedulerActor
        cfg = EngineConfig.from_args(self.engine_args)
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            self.actor = ray.remote(SchedulerActor).options(
                num_cpus=0, max_concurrency=10_000).remote(cfg)
            ray.get(self.actor.ready.remote())
        except BaseException:
            ray.shutdown()
            raise
        return self.actor

    def __exit__(self, *exc) -> None:
        import ray
        try:
            # shutdown kills the actor, so the call itself may end in RayActorError
            with contextlib.suppress(ray.exceptions.RayActorError):
                if self.actor is not None:
                    ray.get(self.actor.shutdown.remote())
        finally:
            ray.shutdown()


def _record(outcomes: dict[str, EngineOutcome], start: float):
    """An on_update callback that notes token and finish times of each request."""
    def on_update(rid: str, update) -> None:
        now = time.perf_counter() - start
        o = outcomes[rid]
        if update.token_ids and o.first_token_s is None:
            o.first_token_s = now
        o.num_generated += len(update.token_ids)
        if update.finish_reason is not None:
            o.finish_s, o.finish_reason = now, update.finish_reason
    return on_update


async def replay(actor, trace: list[TraceRequest]) -> list[EngineOutcome]:
    """Submit each request at its arrival time (one add_requests call each, with its
    deadline), and follow the output stream until every request has finished."""
    from engine_actors.messages import EngineRequest
    from engine_actors.output_stream import OutputStream
    rids = [f"r{i}" for i in range(len(trace))]
    outcomes = {rid: EngineOutcome() for rid in rids}
    unfinished = set(rids)
    start = time.perf_counter()
    stream = OutputStream(actor)
    consumer = asyncio.ensure_future(stream.follow(unfinished, _record(outcomes, start)))
    calls = []
    for rid, r in zip(rids, trace):
        delay = start + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outcomes[rid].submit_s = time.perf_counter() - start
        deadline_ms = None if r.deadline_s is None else r.deadline_s * 1e3
        request = EngineRequest(rid, r.prompt_token_ids, _sampling(r.max_tokens), 0, deadline_ms)
        calls.append(actor.add_requests.remote(stream.client_id, [request]))
    for rid, (refusal,) in zip(rids, await asyncio.gather(*calls)):
        if refusal is not None:
            outcomes[rid].refusal = refusal.code
            unfinished.discard(rid)
    try:
        if unfinished:
            await consumer
    finally:
        consumer.cancel()
        stream.close()
    return [outcomes[rid] for rid in rids]


async def run_batch(actor, prompt_len: int, max_tokens: int, num_requests: int) -> float:
    """`num_requests` identical requests submitted in one call (they start in the same
    iteration); returns the seconds until the last one finished."""
    from engine_actors.messages import EngineRequest
    from engine_actors.output_stream import run_requests
    requests = [EngineRequest(f"b{i}", [7] * prompt_len, _sampling(max_tokens))
                for i in range(num_requests)]
    start = time.perf_counter()
    await run_requests(actor, requests)
    return time.perf_counter() - start
