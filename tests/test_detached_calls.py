"""Serve cancels a request whose client left with `ray.cancel(recursive=True)`, which also
cancels the Ray calls that request made. The abort a cancelled handler sends, and the
replica's output stream, must not be such calls (deployments.engine_client.detached)."""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from deployments.engine_client import detached


@ray.remote
class Scheduler:
    """Stands in for the scheduler actor: records which calls finished or were cancelled."""

    def __init__(self):
        self.log = []

    async def work(self, name: str) -> None:
        self.log.append((name, "started"))
        try:
            await asyncio.sleep(3)
            self.log.append((name, "finished"))
        except asyncio.CancelledError:
            self.log.append((name, "cancelled"))
            raise

    def get_log(self) -> list:
        return self.log


@ray.remote
class Replica:
    """Stands in for an ingress replica handling one request."""

    async def handle(self, scheduler) -> None:
        scheduler.work.remote("plain")
        detached(scheduler.work.remote, "detached")
        await asyncio.sleep(30)


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_recursive_cancel_spares_a_detached_call_but_not_a_plain_one(cluster):
    scheduler, replica = Scheduler.remote(), Replica.remote()
    ray.get([scheduler.get_log.remote(), replica.__ray_ready__.remote()])
    request = replica.handle.remote(scheduler)
    while len(ray.get(scheduler.get_log.remote())) < 2:  # both calls are running now
        time.sleep(0.05)
    ray.cancel(request, recursive=True)  # what Serve does when the client disconnects
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(request, timeout=30)
    for _ in range(100):  # "detached" finishes 3 s after it started
        ends = [e for e in ray.get(scheduler.get_log.remote()) if e[1] != "started"]
        if len(ends) == 2:
            break
        time.sleep(0.1)
    assert dict(ends) == {"plain": "cancelled", "detached": "finished"}
