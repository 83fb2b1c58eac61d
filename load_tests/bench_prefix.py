"""Prefix caching off and on, side by side in one run, through HTTP (the server started as
`make serve` starts it, once per setting, on the same device).

    python -m load_tests.bench_prefix --model llama-8b --out results/prefix.json

Per setting of `enable_prefix_caching`:
  shared-prefix  --num-requests prompts (one system prompt of --prefix-len tokens, then a
                 distinct ~100-token question; 128 output tokens), all sent at t=0:
                 throughput.
  multi-turn     conversations of --turns turns started at --rates conversations/s (one run
                 per rate) for --duration s, each turn sent when the previous answer
                 arrived: TTFT.
  orca           ORCA's trace (no sharing) at t=0: the cost of caching when nothing hits.
Every request goes through load_client (streamed, EOS ignored, usage checked). The table
printed last gives each metric off, on, and on/off.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import time

import httpx

from load_tests.bench_http import launched
from load_tests.load_client import LoadConfig, parse_rates, sweep
from load_tests.traces import multi_turn_trace, orca_trace, shared_prefix_trace
from load_tests.report import save_json


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


def run_setting(caching: bool, engine_args: dict, args) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    v = args.vocab_size
    traces = {"shared-prefix": (shared_prefix_trace(args.num_requests, v, 1, args.prefix_len),
                                math.inf, None)}
    for k, rate in enumerate(args.rates):  # one multi-turn run per rate, each on its own
        # conversations (a seed per rate): a later rate must not find an earlier one's cached
        traces[multi_turn_name(rate, args.rates)] = (
            multi_turn_trace(args.num_conversations * args.turns, v, 2 + 1000 * k, args.turns),
            rate, args.duration)
    traces["orca"] = (orca_trace(args.num_requests, v, 3), math.inf, None)
    out = {"enable_prefix_caching": caching}
    with launched({**engine_args, "enable_prefix_caching": caching}, args.replicas,
                  args.port) as server:
        wait_healthy(url, server)
        for name, (trace, rate, duration) in traces.items():
            if name.split("@")[0] not in args.traces.split(","):
                continue
            cfg = LoadConfig(url, num_warmup=args.warmup, duration_s=duration or 1e9,
                             show_progress=False, drain_timeout_s=1800)
            [res] = asyncio.run(sweep(cfg, trace, [rate]))
            if res["failed"] or res["num_short_outputs"]:
                raise RuntimeError(f"{name}: {res['failed']} failed, "
                                   f"{res['num_short_outputs']} short: {res['errors']}")
            out[name] = res
            print(f"caching={caching} {name}: {res['duration_s']:.2f} s, "
                  f"{res['total_token_throughput']:.0f} tok/s, TTFT p50 "
                  f"{res['ttft_ms']['median']:.1f} ms, cached "
                  f"{res['cached_prompt_fraction']:.2f}", flush=True)
    return out


def multi_turn_name(rate: float, rates: list[float]) -> str:
    return "multi-turn" if len(rates) == 1 else f"multi-turn@{rate:g}"


ROWS = [("shared-prefix", "total_token_throughput", "throughput, tok/s"),
        ("shared-prefix", "duration_s", "elapsed, s"),
        ("multi-turn", ("ttft_ms", "median"), "TTFT p50, ms"),
        ("multi-turn", ("ttft_ms", "p90"), "TTFT p90, ms"),
        ("orca", "duration_s", "elapsed, s"),
        ("orca", "total_token_throughput", "throughput, tok/s")]


def table(off: dict, on: dict) -> str:
    def get(res, key):
        return res[key[0]][key[1]] if isinstance(key, tuple) else res[key]

    lines = ["| trace | metric | caching off | caching on | on / off | cached share (on) |",
             "| --- | --- | --- | --- | --- | --- |"]
    rows = [(name, key, label) for trace, key, label in ROWS
            for name in off if name.split("@")[0] == trace]
    for trace, key, label in rows:
        if trace not in on:
            continue
        a, b = get(off[trace], key), get(on[trace], key)
        lines.append(f"| {trace} | {label} | {a:.2f} | {b:.2f} | {b / a:.2f} | "
                     f"{on[trace]['cached_prompt_fraction']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--num-requests", type=int, default=256, help="shared-prefix and orca")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--num-conversations", type=int, default=200,
                   help="multi-turn: at most this many (the duration may cut it)")
    p.add_argument("--rates", type=parse_rates, default=parse_rates("4"),
                   help="multi-turn: conversations/s, comma-separated (a run per rate)")
    p.add_argument("--duration", type=float, default=60.0, help="multi-turn: seconds")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-num-tokens", type=int, help="KV capacity (default: sized on GPU)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--traces", default="shared-prefix,multi-turn,orca")
    p.add_argument("--data-parallel-size", type=int, default=1, help="the engine arg")
    p.add_argument("--replicas", type=int, default=1, help="ingress replicas")
    p.add_argument("--caching", default="both", choices=["both", "on"],
                   help="on: the run with prefix caching only")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if any(not isinstance(r, float) for r in args.rates) or len(set(args.rates)) < len(args.rates):
        p.error("--rates: distinct numbers (a multi-turn trace has no arrival times to replay)")
    engine_args = {"model": args.model, "device": args.device,
                   "max_batch_size": args.max_batch_size,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "data_parallel_size": args.data_parallel_size}
    if args.max_num_tokens:
        engine_args["max_num_tokens"] = args.max_num_tokens
    off = run_setting(False, engine_args, args) if args.caching == "both" else None
    on = run_setting(True, engine_args, args)
    report = {"args": vars(args), "off": off, "on": on,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    save_json(args.out, report)
    if off is not None:
        print(table(off, on))
    return report


if __name__ == "__main__":
    main()
