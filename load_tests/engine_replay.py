"""The real engine as the simulator's reference: the scheduler actor (and its worker actor)
in a local Ray instance, fed by an asyncio driver.

Used by the calibration (the control-plane cost of an iteration, which in-process step
timings cannot see) and by the simulator's validation (the same trace through the real
engine and through the simulator). Requests carry `ignore_eos` and greedy sampling, so each
generates exactly max_tokens and the cost is that of the cheapest sampler path, as in the
calibration steps.
"""
from __future__ import annotations

import contextlib

import asyncio
import os
import time
import uuid
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


async def _consume(stream, outcomes: dict[str, EngineOutcome], start: float,
                   unfinished: set[str], all_submitted: asyncio.Event) -> None:
    async for ref in stream:
        now = time.perf_counter() - start
        for rid, item in (await ref).items():
            o = outcomes[rid]
            if item["token_ids"] and o.first_token_s is None:
                o.first_token_s = now
            o.num_generated += len(item["token_ids"])
            if item["finish_reason"] is not None:
                o.finish_s, o.finish_reason = now, item["finish_reason"]
                unfinished.discard(rid)
        if all_submitted.is_set() and not unfinished:
            return


async def replay(actor, trace: list[TraceRequest]) -> list[EngineOutcome]:
    """Submit each request at its arrival time (one add_request call each, with its deadline),
    and follow the client's output stream until every request has finished."""
    client = uuid.uuid4().hex
    rids = [f"r{i}" for i in range(len(trace))]
    outcomes = {rid: EngineOutcome() for rid in rids}
    unfinished = set(rids)
    all_submitted = asyncio.Event()
    start = time.perf_counter()
    consumer = asyncio.ensure_future(_consume(actor.stream.remote(client), outcomes, start,
                                              unfinished, all_submitted))
    calls = []
    for rid, r in zip(rids, trace):
        delay = start + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outcomes[rid].submit_s = time.perf_counter() - start
        deadline_ms = None if r.deadline_s is None else r.deadline_s * 1e3
        calls.append(actor.add_request.remote(client, rid, r.prompt_token_ids,
                                              _sampling(r.max_tokens), 0, deadline_ms))
    for rid, refusal in zip(rids, await asyncio.gather(*calls)):
        if refusal is not None:
            outcomes[rid].refusal = refusal
            unfinished.discard(rid)
    all_submitted.set()
    if unfinished:
        await consumer
    else:
        consumer.cancel()
    return [outcomes[rid] for rid in rids]


async def run_batch(actor, prompt_len: int, max_tokens: int, num_requests: int) -> float:
    """`num_requests` identical requests submitted in one call (they start in the same
    iteration); returns the seconds until the last one finished."""
    trace = [TraceRequest([7] * prompt_len, max_tokens) for _ in range(num_requests)]
    client = uuid.uuid4().hex
    rids = [f"b{i}" for i in range(num_requests)]
    outcomes = {rid: EngineOutcome() for rid in rids}
    done = asyncio.Event()
    done.set()
    start = time.perf_counter()
    consumer = asyncio.ensure_future(_consume(actor.stream.remote(client), outcomes, start,
                                              set(rids), done))
    refusals = await actor.add_requests.remote(
        client, [(rid, r.prompt_token_ids, _sampling(r.max_tokens)) for rid, r in zip(rids, trace)])
    if any(refusals):
        consumer.cancel()
        raise RuntimeError(f"the engine refused the calibration requests: {refusals[0]}")
    await consumer
    return time.perf_counter() - start
