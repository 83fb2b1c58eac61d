"""What the HTTP path costs in the ingress replica's own process: CPU time per request and
per generated token, through the route users call, on any machine (the model hardly
matters: the replica's work is validation, tokens, JSON, SSE and its Ray calls).

    python -m load_tests.bench_replica --device cpu --requests 512 --tokens 1 64

The application of serve_config.yaml is started as `make serve` starts it
(`deployments.launch`); for each output length (and with --stream, streamed too), N requests
are sent at once by one asyncio client (token-id prompts, greedy, EOS ignored, usage
checked), and the replica's CPU seconds (user + system, from /proc) are read before and
after, less its idle rate measured first. Two output lengths give the split:
per token = (cpu(long) - cpu(short)) / (N * (long - short)), per request = cpu(short) / N
less the tokens. A single replica ingests a burst of requests at about 1 / (per request)
per second, the bound on how fast the engine hears of them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from load_tests.bench_http import _one, _server_pids, _wait_healthy, launched
from load_tests.traces import TraceRequest
from load_tests.report import save_json


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _measure(url: str, args) -> dict:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=connector) as session:
        await _wait_healthy(session, url)
        pid = _server_pids()["replica"]
        await asyncio.gather(*[_one(session, url, TraceRequest(list(range(1, 40)), 8), False)
                               for _ in range(32)])  # warm-up
        before = _cpu_s(pid)
        await asyncio.sleep(args.idle_s)
        idle_rate = (_cpu_s(pid) - before) / args.idle_s
        runs = []
        for stream in [False, True] if args.stream else [False]:
            for tokens in args.tokens:
                trace = [TraceRequest(list(range(1, 40 + i % 64)), tokens)
                         for i in range(args.requests)]
                start, cpu = time.perf_counter(), _cpu_s(pid)
                done = await asyncio.gather(*[_one(session, url, r, stream) for r in trace])
                elapsed = time.perf_counter() - start
                busy = _cpu_s(pid) - cpu - idle_rate * elapsed
                if done != [tokens] * len(trace):
                    raise RuntimeError("a response had the wrong completion_tokens")
                runs.append({"stream": stream, "tokens": tokens, "elapsed_s": elapsed,
                             "replica_cpu_s": busy,
                             "cpu_ms_per_request": busy / len(trace) * 1e3})
    report = {"requests": args.requests, "idle_cpu_ms_per_s": idle_rate * 1e3, "runs": runs}
    lo, hi = min(args.tokens), max(args.tokens)
    for stream in sorted({r["stream"] for r in runs}):
        by_tokens = {r["tokens"]: r["replica_cpu_s"] for r in runs if r["stream"] == stream}
        if hi > lo:
            per_token = (by_tokens[hi] - by_tokens[lo]) / (args.requests * (hi - lo))
            per_request = by_tokens[lo] / args.requests - lo * per_token
            name = "stream" if stream else "json"
            report[f"{name}_us_per_token"] = per_token * 1e6
            report[f"{name}_ms_per_request"] = per_request * 1e3
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random-llama")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--stream", action="store_true", help="also streamed (SSE)")
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--server-env", default="", metavar="K=V,...")
    p.add_argument("--out")
    args = p.parse_args(argv)
    engine_args = {"model": args.model, "device": args.device, "max_batch_size": 256,
                   "max_num_batched_tokens": 8192, "enable_prefix_caching": False}
    if args.device == "cpu":
        engine_args["max_num_tokens"] = 200_000
    server_env = dict(kv.split("=", 1) for kv in filter(None, args.server_env.split(",")))
    with launched(engine_args, 1, args.port, server_env):
        report = asyncio.run(_measure(f"http://127.0.0.1:{args.port}", args))
    report.update(model=args.model, device=args.device, server_env=args.server_env)
    print(json.dumps(report, indent=2))
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
