"""ORCA's offline trace through the HTTP route users call, beside the engine in-process.

    python -m load_tests.bench_http --model llama-8b --out http.json

Systems, one after another on the same device, the same trace (token-id prompts, greedy,
EOS ignored, every request sent at t=0):
  orca           the engine in-process (bench_offline's `orca`: scheduler actor + worker)
  http           `deployments.launch` (as `make serve`: HAProxy in front of the ingress
                 replica, deployments/serve_env.py) and POST /v1/completions
  http-stream    the same with stream: true (server-sent events)
  ...-rN         with N ingress replicas (http-r2, http-stream-r4; --replicas 2,4 adds
                 http-r2 and http-r4)
  ...-proxy      through Serve's Python proxy instead of HAProxy (RAY_SERVE_ENABLE_HA_PROXY=0:
                 what a plain `serve run` gives), e.g. http-proxy, http-stream-proxy
  ...-chat       POST /v1/chat/completions instead, ...-responses POST /v1/responses and
                 ...-messages Anthropic's POST /v1/messages (e.g. http-stream-chat,
                 http-stream-messages): one user message whose text is the prompt's ids as
                 letters (one letter per id), the same for the three routes
Each HTTP system checks every response's usage.completion_tokens against the trace and
reports elapsed seconds and its ratio to `orca`. Systems that differ only in streaming share
one server, one after the other; prefix caching is off for every system (a second run would
find the trace's prompts cached). The client is one asyncio process
(aiohttp, connections unbounded), as lean as a client can be in Python. Before each timed
run it holds one open connection per request of the trace, as a long-lived client (the
`openai` SDK's pool) has them; with --cold-connections the timed run opens them itself,
and the client's own cost of opening 256 connections at once (~0.3 s of its CPU on the GPU
machine) is then part of the figure.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

from load_tests.traces import TraceRequest
from load_tests.report import save_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAME = "bench"  # the served model's name (the Messages API requires `model`)


def write_config(engine_args: dict, replicas: int, port: int) -> str:
    with open(os.path.join(ROOT, "serve_config.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["args"] = {k: v for k, v in app["args"].items() if k != "max_num_tokens"}
    app["args"].update(engine_args, served_model_name=MODEL_NAME)
    app["deployments"][0]["num_replicas"] = replicas
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


@contextlib.contextmanager
def launched(engine_args: dict, replicas: int = 1, port: int = 8000,
             server_env: dict | None = None, log: str | None = None):
    """The application of serve_config.yaml with these engine args, started as `make serve`
    starts it (`deployments.launch`, so it drains and stops cleanly); yields the process.
    The caller waits until /health answers. `log`: a file for the server's output."""
    config = write_config(engine_args, replicas, port)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           **(server_env or {})}
    out = open(log, "w") if log else subprocess.DEVNULL
    server = subprocess.Popen([sys.executable, "-m", "deployments.launch", config], cwd=ROOT,
                              env=env, stdout=out, stderr=subprocess.STDOUT if log else out)
    try:
        yield server
    finally:
        server.terminate()  # drains, then stops serve run and its Ray cluster
        server.wait(timeout=120)
        os.unlink(config)
        if log:
            out.close()


async def _wait_healthy(session, url: str, timeout_s: float = 600.0) -> None:
    import aiohttp
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def _body(r: TraceRequest, stream: bool, route: str) -> dict:
    """The request of `route` for one trace request (greedy, EOS ignored)."""
    common = {"temperature": 0, "ignore_eos": True, "stream": stream}
    if stream and route in ("completions", "chat"):
        common["stream_options"] = {"include_usage": True}
    if route == "completions":
        return {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, **common}
    text = "".join(chr(ord("a") + t % 26) for t in r.prompt_token_ids)
    if route == "chat":
        return {"messages": [{"role": "user", "content": text}], "max_tokens": r.max_tokens,
                **common}
    if route == "messages":
        return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
                "max_tokens": r.max_tokens, **common}
    return {"input": text, "max_output_tokens": r.max_tokens, **common}


async def _one(session, url: str, r: TraceRequest, stream: bool, route: str) -> int:
    """Completion tokens of one request (from usage; streamed: the last usage chunk, the
    Responses API's final event, or the Messages API's message_delta)."""
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
            "responses": "/v1/responses", "messages": "/v1/messages"}[route]
    async with session.post(url + path, json=_body(r, stream, route)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            return _output_tokens((await resp.json())["usage"])
        usage, buf = None, b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event[event.find(b"data: ") + 6:]
                if data.startswith(b"{") and b'"usage": {' in data and \
                        b'"message_start"' not in data:  # (its usage has no output yet)
                    body = json.loads(data)
                    usage = body["response"]["usage"] if "response" in body else body["usage"]
        return _output_tokens(usage)


def _output_tokens(usage: dict) -> int:
    return usage["completion_tokens"] if "completion_tokens" in usage else usage["output_tokens"]


HTTP_SYSTEM = re.compile(r"http(?P<stream>-stream)?(?:-(?P<route>chat|responses|messages))?"
                         r"(?:-r(?P<replicas>\d+))?(?P<proxy>-proxy)?")
PROCESSES = {"proxy": "ProxyActor", "replica": "ServeReplica", "scheduler": "SchedulerActor"}


def _server_pids() -> dict[str, int]:
    """The Serve proxy, an ingress replica and the scheduler actor (by their titles)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = {}
    for line in out.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        for name, mark in PROCESSES.items():
            if mark in args and name not in pids:
                pids[name] = int(pid)
    return pids


def _py_spy() -> str:
    """The py-spy binary: on PATH, beside this Python, or in a `pip --target` dir's bin/."""
    candidates = [shutil.which("py-spy"), os.path.join(os.path.dirname(sys.executable), "py-spy")]
    candidates += [os.path.join(p, "bin", "py-spy") for p in sys.path if p]
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy)")
    return found


def _start_profiles(profile_dir: str | None, seconds: float) -> list[subprocess.Popen]:
    """py-spy on each server process while the trace runs: non-blocking sampling (native
    frames would need py-spy to pause the process at every sample)."""
    if not profile_dir:
        return []
    os.makedirs(profile_dir, exist_ok=True)
    return [subprocess.Popen([_py_spy(), "record", "-p", str(pid), "-d", str(int(seconds) + 1),
                              "-r", "200", "-f", "raw", "--nonblocking",
                              "-o", os.path.join(profile_dir, f"{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in _server_pids().items()]


async def _open_connections(session, url: str, n: int) -> None:
    """n connections in the session's pool: n requests at once (GET /v1/models, answered by
    the replica alone), each keeps its connection when it ends."""
    async def one():
        async with session.get(f"{url}/v1/models") as resp:
            await resp.read()

    await asyncio.gather(*[one() for _ in range(n)])


async def _replay(url: str, trace: list[TraceRequest], warmup: list[TraceRequest],
                  modes: list[tuple[bool, str]], profile_dirs: list[str | None],
                  cold_connections: bool = False) -> list[tuple[float, float]]:
    """For each mode ((stream or not, route)), in turn: (elapsed s, the client's own CPU s) of the
    timed trace, after a warm-up in that mode. A client whose CPU time nears the elapsed
    time is what limits the run."""
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    results = []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await _wait_healthy(session, url)
        for (stream, route), profile_dir in zip(modes, profile_dirs):
            start = time.perf_counter()
            await asyncio.gather(*[_one(session, url, r, stream, route) for r in warmup])
            if not cold_connections:
                await _open_connections(session, url, len(trace))
            profiles = _start_profiles(profile_dir, 3 * (time.perf_counter() - start) + 2)
            await asyncio.sleep(0.5 if profiles else 0.0)  # py-spy attaches
            start, cpu = time.perf_counter(), time.process_time()
            tokens = await asyncio.gather(*[_one(session, url, r, stream, route)
                                            for r in trace])
            results.append((time.perf_counter() - start, time.process_time() - cpu))
            for p in profiles:
                p.wait()
            wrong = [i for i, (n, r) in enumerate(zip(tokens, trace)) if n != r.max_tokens]
            if wrong:
                raise RuntimeError(f"{len(wrong)} responses with the wrong completion_tokens")
    return results


def run_http(engine_args: dict, trace, warmup, modes: list[tuple[bool, str]], replicas: int,
             port: int = 8000, profile_dirs: list[str | None] | None = None,
             server_env: dict | None = None, cold_connections: bool = False) -> list[dict]:
    """One server (`deployments.launch`), the trace once per mode (stream or not, route)."""
    started = time.perf_counter()
    with launched(engine_args, replicas, port, server_env):
        runs = asyncio.run(_replay(f"http://127.0.0.1:{port}", trace, warmup, modes,
                                   profile_dirs or [None] * len(modes), cold_connections))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            health = json.load(resp)  # the KV pool's size, as the server sized it
        stopping = time.perf_counter()
    print(f"server up and runs {stopping - started:.0f} s, stop "
          f"{time.perf_counter() - stopping:.0f} s", file=sys.stderr)
    return [{"elapsed_s": elapsed, "client_cpu_s": cpu, "replicas": replicas, "stream": stream,
             "route": route, "server_env": server_env or {},
             "cold_connections": cold_connections, "kv_blocks": health["num_blocks"],
             "kv_cache_dtype": engine_args.get("kv_cache_dtype", "auto"),
             "data_parallel_size": engine_args.get("data_parallel_size", 1)}
            for (stream, route), (elapsed, cpu) in zip(modes, runs)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--systems", default="orca,http,http-stream",
                   help="orca, and HTTP systems named as above")
    p.add_argument("--replicas", default="", help="adds http-rN for each N, e.g. 2,4")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-len", type=int, nargs=2, default=(1, 128))
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--server-env", default="", metavar="K=V,...",
                   help="environment of the server processes (Serve's knobs, for example)")
    p.add_argument("--label", default="", help="appended to the HTTP systems' names")
    p.add_argument("--cold-connections", action="store_true",
                   help="the timed runs open their connections (default: opened before)")
    p.add_argument("--profile", metavar="DIR", help="py-spy the server processes during the "
                   "timed runs (DIR/<system>-<process>.txt, collapsed stacks)")
    p.add_argument("--quantization", choices=["fp8"], help="the engine arg")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"],
                   help="the engine arg")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="the HTTP servers' engine arg (the in-process run has one engine)")
    p.add_argument("--out")
    args = p.parse_args(argv)

    from load_tests.bench_offline import offline_traces, run_orca
    trace, warmup = offline_traces(args)
    # prefix caching off: a server's second run of the trace would find its prompts cached
    engine_args = dict(model=args.model, device=args.device, max_batch_size=args.max_batch_size,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_prefix_caching=False)
    if args.device == "cpu":
        engine_args["max_num_tokens"] = 200_000
    if args.quantization:
        engine_args["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        engine_args["kv_cache_dtype"] = args.kv_cache_dtype
    results = []
    systems = args.systems.split(",")
    if "orca" in systems:
        res, _ = run_orca(engine_args, trace, warmup)
        results.append({"system": "orca", "elapsed_s": res["elapsed_s"]})
    server_env = dict(kv.split("=", 1) for kv in filter(None, args.server_env.split(",")))

    # one server per (replicas, proxy): its streamed and non-streamed runs share it
    servers: dict[tuple[int, bool], list[str]] = {}
    for name in systems + [f"http-r{n}" for n in filter(None, args.replicas.split(","))]:
        if name == "orca":
            continue
        m = HTTP_SYSTEM.fullmatch(name)
        if m is None:
            p.error(f"unknown system {name!r}")
        servers.setdefault((int(m["replicas"] or 1), bool(m["proxy"])), []).append(name)
    for (replicas, proxy), names in servers.items():
        env = {**server_env, "RAY_SERVE_ENABLE_HA_PROXY": "0"} if proxy else server_env
        modes = [(bool(m["stream"]), m["route"] or "completions")
                 for m in map(HTTP_SYSTEM.fullmatch, names)]
        profiles = [os.path.join(args.profile, n + args.label) if args.profile else None
                    for n in names]
        http_args = {**engine_args, "data_parallel_size": args.data_parallel_size}
        runs = run_http(http_args, trace, warmup, modes, replicas, profile_dirs=profiles,
                        server_env=env, cold_connections=args.cold_connections)
        for name, res in zip(names, runs):
            results.append({"system": name + args.label, **res})
            print(f"{name}: {res['elapsed_s']:.2f} s", flush=True)  # a cut-off run keeps these
    base = next((r["elapsed_s"] for r in results if r["system"] == "orca"), None)
    for r in results:
        r["vs_orca"] = r["elapsed_s"] / base if base else None
    report = {"model": args.model, "device": args.device, "num_requests": len(trace),
              "results": results}
    print("| system | elapsed s | vs in-process | client CPU s |\n| --- | --- | --- | --- |")
    for r in results:
        ratio = f"{r['vs_orca']:.2f}x" if r["vs_orca"] else "-"
        cpu = f"{r['client_cpu_s']:.2f}" if "client_cpu_s" in r else "-"
        print(f"| {r['system']} | {r['elapsed_s']:.2f} | {ratio} | {cpu} |")
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
