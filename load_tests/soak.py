"""Soak test (not in CI): hours-long behaviour in minutes. Serve at 80% of measured capacity
for a long time and check that nothing degrades: no 5xx, and memory and KV back to baseline.

    python -m load_tests.soak --duration 600 --out load_tests/results/soak-cpu.json

It starts the application of serve_config.yaml (the tiny model on CPU by default), measures
capacity with a burst of requests sent all at once, then offers 80% of it as Poisson arrivals
of TCB-like requests (short prompts and answers) for --duration seconds, through the same
load client as load_tests/load_client.py. Memory is the resident set of every Ray process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import threading
import time

import httpx
import psutil

from load_tests.load_client import LoadConfig, sweep
from load_tests.traces import make_trace
from load_tests.report import save_json


def ray_memory_mb() -> dict:
    """Memory of all Ray processes (workers, raylet, GCS, Serve), MB: resident (which counts
    the shared object store pages each process has touched) and unique (what it alone holds,
    the number a leak grows), and the unique memory of each kind of process, to find one."""
    rss = uss = 0
    by_process: dict[str, float] = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            text = " ".join([p.info["name"] or ""] + (p.info["cmdline"] or []))
            if "ray::" in text or "raylet" in text or "gcs_server" in text:
                mem = p.memory_full_info()
                rss, uss = rss + mem.rss, uss + mem.uss
                label = process_label(text)
                by_process[label] = by_process.get(label, 0.0) + mem.uss / 2**20
        except (psutil.Error, TypeError):
            continue
    return {"rss": rss / 2**20, "uss": uss / 2**20,
            "uss_by_process": {k: round(v, 1) for k, v in sorted(by_process.items())}}


def process_label(text: str) -> str:
    """"ray::SchedulerActor.step" -> "SchedulerActor"; raylet, gcs_server, dashboard... as is."""
    if "ray::" in text:
        return text.split("ray::", 1)[1].split()[0].split(".")[0].split(":")[0] or "ray::"
    for name in ("gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor", "raylet"):
        if name in text:
            return name
    return "other"


class MemorySampler(threading.Thread):
    """Ray's memory every `period_s` during the soak, to tell a plateau from a leak."""

    def __init__(self, period_s: float):
        super().__init__(daemon=True)
        self.period_s, self.samples, self.stop = period_s, [], threading.Event()

    def run(self):
        start = time.monotonic()
        while not self.stop.wait(self.period_s):
            self.samples.append({"t_s": round(time.monotonic() - start), **ray_memory_mb()})


def wait_idle(url: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = httpx.get(f"{url}/health", timeout=10).json()
        if s.get("num_requests") == 0 and s.get("num_free_blocks") == s.get("num_blocks"):
            return s
        time.sleep(0.5)
    raise RuntimeError(f"the engine did not return to idle: {s}")


def count_5xx(result: dict) -> int:
    return sum(e["count"] for e in result.get("errors", []) if e["error"].startswith("HTTP 5"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    p.add_argument("--capacity-requests", type=int, default=300)
    p.add_argument("--out")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from tests.serve_fixture import app_config, shutdown, start_app, stop_app
    url = start_app(app_config())
    try:
        trace = make_trace("tcb", 2000, 256, seed=0)
        quick = LoadConfig(url, duration_s=1e9, max_requests=args.capacity_requests,
                           show_progress=False, num_warmup=8)
        capacity = asyncio.run(sweep(quick, trace, [float("inf")]))[0]["request_throughput"]
        before_kv = wait_idle(url)
        before_mb = ray_memory_mb()
        rate = args.load * capacity
        soak = LoadConfig(url, duration_s=args.duration, num_warmup=0, show_progress=True)
        sampler = MemorySampler(period_s=args.duration / 10)
        sampler.start()
        # prompts the probe did not send, and none twice: no run is served from the cache
        fresh = make_trace("tcb", math.ceil(rate * args.duration) + 1, 256, seed=1)
        result = asyncio.run(sweep(soak, fresh, [rate]))[0]
        sampler.stop.set()
        after_kv = wait_idle(url)
        after_mb = ray_memory_mb()
    finally:
        stop_app()
        shutdown()
    report = {"date": time.strftime("%Y-%m-%d"), "duration_s": args.duration,
              "capacity_req_s": capacity, "offered_req_s": rate, "result": result,
              "num_5xx": count_5xx(result),
              "kv_free_blocks_before": before_kv["num_free_blocks"],
              "kv_free_blocks_after": after_kv["num_free_blocks"],
              "num_blocks": after_kv["num_blocks"],
              "ray_memory_mb_before": before_mb, "ray_memory_mb_after": after_mb,
              "ray_memory_mb_during": sampler.samples}
    print(json.dumps({k: v for k, v in report.items() if k != "result"}, indent=2))
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
