"""Start the application of serve_config.yaml with serve.run (same builder, same args)."""
from __future__ import annotations

import os
import pathlib
import socket
import time

import httpx
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(**overrides) -> dict:
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = cfg["applications"][0]
    app["args"].update(overrides)
    return app


def write_config(tmp_path, **args) -> tuple[pathlib.Path, int]:
    """serve_config.yaml on a free port with these application args; (file, port)."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(args)
    config_file = tmp_path / "serve_config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    return config_file, port


def own_ports_env() -> dict:
    """This environment, with ports of its own for the Serve of a `serve run` that a test
    starts: the in-process Serve of start_app (maybe another test worker's, beside it) keeps
    HAProxy's fixed statistics, metrics and fallback proxy ports, and the ingress replicas'
    first ports."""
    env = dict(os.environ)
    for key in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"):
        env.setdefault(key, str(free_port()))
    env.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "31000")
    env.setdefault("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "32000")
    return env


_serve_url: str | None = None  # of the Ray and Serve instance that start_app keeps up


def start_app(app: dict):
    """Run the application; Ray and Serve start on the first call and stay up for the
    next module's (stop_app deletes only the applications; shutdown ends them)."""
    global _serve_url
    import ray
    from ray import serve

    from deployments.app import build_app
    if _serve_url is None:
        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _serve_url = f"http://127.0.0.1:{port}"
    try:
        serve.run(build_app(app["args"]), name=app["name"], route_prefix=app["route_prefix"])
        wait_healthy(_serve_url)
    except BaseException:
        stop_app()  # its engine must not hold the next module's CPUs
        raise
    return _serve_url


def wait_healthy(url: str, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def wait_idle(url: str, timeout: float = 20.0, headers: dict | None = None) -> dict:
    """Until no request is left and every KV block is free again; the final /health body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = httpx.get(f"{url}/health", timeout=10, headers=headers).json()
        if s.get("num_requests") == 0 and s.get("num_free_blocks") == s.get("num_blocks"):
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine not back to baseline: {s}")


def stop_app(timeout: float = 60.0):
    """Delete every application and wait until their engines are gone (their workers'
    placement groups free the CPUs the next application's workers need). Nothing to do once
    shutdown has ended the instance."""
    if _serve_url is None:
        return
    import ray
    from ray import serve
    from ray.util import placement_group_table

    from engine_actors.scheduler_actor import NAMESPACE
    for name in serve.status().applications:
        serve.delete(name)

    def engine_left() -> bool:
        # the scheduler (a named detached actor) goes after its workers' placement group
        return any(pg["state"] != "REMOVED" for pg in placement_group_table().values()) or \
            any(a["namespace"] == NAMESPACE for a in ray.util.list_named_actors(True))
    deadline = time.monotonic() + timeout
    while engine_left():
        if time.monotonic() > deadline:
            raise TimeoutError("an engine outlived its application")
        time.sleep(0.2)


def shutdown():
    """End the Ray and Serve instance of start_app, if it runs (the end of the session)."""
    global _serve_url
    import ray
    if not ray.is_initialized():
        return
    from ray import serve
    serve.shutdown()
    ray.shutdown()
    _serve_url = None


def start_long_stream(url: str, prompt: str, events: list):
    """Stream a 3500-token completion in a thread, appending its events to `events`;
    returns the thread once the first event has arrived."""
    import json
    import threading

    def run():
        body = {"prompt": prompt, "max_tokens": 3500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    thread = threading.Thread(target=run)
    thread.start()
    while not events:
        time.sleep(0.05)
    return thread
