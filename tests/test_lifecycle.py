"""The scheduler actor's life: one per application, replaced if it dies, gone with the app."""
from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from engine_actors.config import EngineConfig
from engine_actors.scheduler_actor import NAMESPACE, actor_name
from tests.serve_fixture import app_config, start_app, start_long_stream, stop_app, wait_healthy

pytestmark = pytest.mark.own_server  # conftest runs these modules last


@pytest.fixture(scope="module")
def app():
    cfg = app_config(drain_timeout_s=2.0)
    url = start_app(cfg)
    yield url, cfg
    stop_app()


def scheduler_handle(cfg):
    import ray
    return ray.get_actor(actor_name(EngineConfig.from_args(cfg["args"])), namespace=NAMESPACE)


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_scheduler_death_fails_in_flight_requests_then_recovers(app):
    import ray
    url, cfg = app
    old = scheduler_handle(cfg)

    async def long_request():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await http.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 3000, "ignore_eos": True})

    async def scenario():
        task = asyncio.create_task(long_request())
        await asyncio.sleep(1.0)
        ray.kill(old)
        t0 = time.monotonic()
        response = await task
        return response, time.monotonic() - t0

    response, waited = asyncio.run(scenario())
    assert response.status_code == 503 and response.json()["error"]["message"]
    assert waited < 5.0  # answered at once, not after a timeout
    ok = httpx.post(f"{url}/v1/completions", timeout=120,
                    json={"prompt": "again", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert scheduler_handle(cfg)._actor_id != old._actor_id
    assert wait_healthy(url)["status"] == "ok"


def test_dead_ingress_replica_loses_its_requests_not_the_engine(app):
    import ray
    url, cfg = app
    scheduler = scheduler_handle(cfg)

    async def orphan():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            try:
                await http.post("/v1/completions", json={
                    "prompt": "orphan", "max_tokens": 3500, "ignore_eos": True})
            except httpx.HTTPError:
                pass

    background = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "input": "orphan", "max_output_tokens": 3500, "ignore_eos": True, "background": True})
    assert background.json()["status"] == "queued", background.text

    async def scenario():
        task = asyncio.create_task(orphan())
        await asyncio.sleep(1.0)
        assert ray.get(scheduler.stats.remote())["num_requests"] == 2
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if "SERVE_REPLICA" in a["name"]]
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]))
        await task

    asyncio.run(scenario())

    def only_new_replica_left():
        s = ray.get(scheduler.stats.remote())
        return s["num_clients"] == 1 and s["num_requests"] == 0 \
            and s["num_free_blocks"] == s["num_blocks"]

    assert wait_until(only_new_replica_left, timeout=60), ray.get(scheduler.stats.remote())
    assert wait_healthy(url)["status"] == "ok"
    # the background response that the dead replica ran: failed, as any replica now says
    stored = httpx.get(f"{url}/v1/responses/{background.json()['id']}", timeout=30).json()
    assert stored["status"] == "failed" and "stopped" in stored["error"]["message"], stored


def successes(url: str) -> float:
    """orca:request_success_total{finished_reason="length"} as GET /metrics reports it."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "orca:request_success_total"
                and s.labels["finished_reason"] == "length")


def test_a_replica_leaving_does_not_stop_the_shared_engine(app):
    """Scale 1 -> 2 -> 1 replicas: the replica that stops must not drain the engine the
    other one still serves from. GET /metrics counts the requests of both replicas, on
    either of them, and still counts the stopped one's afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from deployments.ingress import METRICS_PUSH_S, OpenAIIngress
    url, cfg = app
    engine = EngineConfig.from_args(cfg["args"])

    def complete(_):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": "still", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    before = successes(url)
    for replicas in (2, 1):
        ingress = OpenAIIngress.options(num_replicas=replicas,
                                        graceful_shutdown_timeout_s=engine.drain_timeout_s + 15)
        serve.run(ingress.bind(engine), name=cfg["name"], route_prefix=cfg["route_prefix"])
        if replicas == 2:  # requests over both replicas, then every answer counts them all
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(complete, range(16)))
            time.sleep(METRICS_PUSH_S + 1)
            assert [successes(url) - before for _ in range(6)] == [16] * 6
    time.sleep(3)  # the extra replica has stopped
    assert wait_healthy(url)["status"] == "ok"
    complete(0)
    assert successes(url) - before == 17  # the same engine: nothing restarted it


def test_a_drain_waits_for_a_beam_search_between_its_steps(app):
    """A search runs as one engine request per step: between two steps none is in the
    engine, and the drain (launch.py's, on SIGTERM) must not end there."""
    import ray
    url, cfg = app
    scheduler = scheduler_handle(cfg)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            search = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": "x", "n": 2, "use_beam_search": True, "max_tokens": 40,
                "ignore_eos": True, "return_token_ids": True}))
            await asyncio.sleep(0.3)
            drained = asyncio.wrap_future(scheduler.drain.remote(30).future())
            await asyncio.wait([search, drained], return_when=asyncio.FIRST_COMPLETED)
            search_first = search.done()  # (the launcher stops Serve once the drain returns)
            await drained
            return await search, search_first
    response, search_first = asyncio.run(scenario())
    assert search_first, "the drain ended before the beam search"
    assert response.status_code == 200, response.text
    assert [len(c["token_ids"]) for c in response.json()["choices"]] == [40, 40]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}).status_code == 503
    ray.kill(scheduler)  # a new scheduler (not draining) for the next tests
    # (a request sent before the replica hears of the kill meets the dead one: a 503)
    deadline = time.monotonic() + 60
    while True:
        ok = httpx.post(f"{url}/v1/completions", timeout=120,
                        json={"prompt": "again", "max_tokens": 3, "ignore_eos": True})
        if ok.status_code != 503 or time.monotonic() > deadline:
            break
        assert ok.json()["error"]["message"] == "scheduler unavailable", ok.text
        time.sleep(0.2)
    assert ok.status_code == 200, ok.text


def test_deleting_the_application_drains_then_tears_the_engine_down(app):

    import ray
    from ray import serve
    from ray.util import placement_group_table
    url, cfg = app
    scheduler_handle(cfg)  # exists while the app runs
    events = []

    stream = start_long_stream(url, "x", events)
    serve.delete(cfg["name"])  # what `serve shutdown` does to every application
    stream.join(timeout=60)
    # the running request ended cleanly after drain_timeout_s, not with a cut connection
    assert events[-1]["choices"][0]["finish_reason"] == "abort"

    def gone():
        try:
            scheduler_handle(cfg)
            return False
        except ValueError:
            return True

    assert wait_until(gone), "scheduler actor outlived its application"
    live_pgs = [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
    assert wait_until(lambda: not [
        pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]), live_pgs
    workers = [a for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [a for a in workers if a["namespace"] == NAMESPACE]


def test_building_the_application_starts_the_engine(app):
    """The engine starts as the application is built (its weights load while Serve starts
    the ingress replicas), with no replica asking for it."""
    import ray

    from deployments.app import build_app
    args = {**app[1]["args"], "served_model_name": "built-only"}  # a scheduler of its own
    build_app(args)  # never deployed: no replica starts

    def state():
        try:
            return ray.get(scheduler_handle({"args": args}).stats.remote())["state"]
        except (ValueError, ray.exceptions.RayActorError):  # no such actor, or it is exiting
            return None
    try:
        assert wait_until(lambda: state() == "ready", timeout=60), state()
    finally:
        with contextlib.suppress(ray.exceptions.RayActorError, ValueError):
            ray.get(scheduler_handle({"args": args}).shutdown.remote())
    assert wait_until(lambda: state() is None, timeout=30)


def test_engine_that_cannot_start_reports_why_and_leaves_nothing(app, tmp_path):
    import ray
    from ray import serve

    from deployments.app import build_app
    from engine_actors.checkpoint import save_random_llama
    url, _ = app
    save_random_llama(str(tmp_path))
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()  # a checkpoint directory without its weights
    args = {"model": str(tmp_path), "max_num_tokens": 4096}
    serve.run(build_app(args), name="broken", route_prefix="/broken")
    r = httpx.post(f"{url}/broken/v1/completions", json={"prompt": "x"}, timeout=120)
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "engine_start_failed"
    assert "safetensors" in error["message"] and "Traceback" not in error["message"]
    health = httpx.get(f"{url}/broken/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "safetensors" in health.json()["reason"]

    def gone():
        try:
            ray.get_actor(actor_name(EngineConfig.from_args(args)), namespace=NAMESPACE)
            return False
        except ValueError:
            return True

    serve.delete("broken")  # the failed scheduler goes with its application
    assert wait_until(gone, timeout=30), "a scheduler that failed to start stayed alive"
