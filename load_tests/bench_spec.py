"""Speculative decoding with n-gram drafts: what a verifying step costs, and what users see
through HTTP with and without it.

    python -m load_tests.bench_spec steps --model llama-8b --out spec-steps.json
    python -m load_tests.bench_spec http --model llama-8b --out spec-http.json

`steps`: the step time of B requests each verifying d draft tokens (1 + d query tokens,
1 + d samples) against a plain decode step (d = 0), on a ModelRunner with the server's
graphs (decode graphs up to the batch, mixed-step graphs up to --max-step-tokens), launched
back to back and timed with CUDA events. A step of d drafts pays off when it yields more
than its time over the plain step's in tokens: 1 + the accepted drafts.

`http`: three servers, one after another (`deployments.launch`, as `make serve`): the
default (async scheduling), async scheduling off (what speculation needs), and
speculative_config. For each concurrency C and temperature, C clients each stream one
completion after another (token-id prompts that repeat a phrase, EOS ignored) for
--requests rounds; reported: output tokens/s, the median time per output token after the
first (TPOT) over requests, and, with speculation, the draft tokens accepted (from /metrics).
The model's weights are random: what its outputs repeat, and so the acceptance, is not a
trained model's. Temperature 1 over a random model's flat distribution accepts almost no
draft, which shows what speculation costs when it fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
import urllib.request

from load_tests.report import save_json

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}


def run_steps(args) -> dict:
    import torch

    from engine_actors import cuda_graphs
    from engine_actors.checkpoint import resolve_model_path
    from engine_actors.kv_cache import cdiv
    from engine_actors.model_runner import ModelRunner
    from load_tests.bench_decode import time_decode
    if args.token_sizes:
        cuda_graphs.TOKEN_SIZES = [int(t) for t in args.token_sizes.split(",")]
    max_batch = max(args.batch_sizes)
    runner = ModelRunner(resolve_model_path(args.model), "cuda", torch.bfloat16, 8192, 16,
                         max_batch, 0)
    runner.allocate_kv_cache(max_batch * cdiv(args.context_len + (args.iters + 16) * 9, 16))
    runner.capture_cuda_graphs(max_batch, args.max_step_tokens, 1 + max(args.drafts))
    rows = []
    for batch in args.batch_sizes:
        plain = None
        for d in args.drafts:
            replays = runner.num_graph_replays, runner.num_mixed_replays
            ms = time_decode(runner, batch, args.context_len, args.iters, drafts=d)
            plain = plain or ms
            path = "decode graph" if runner.num_graph_replays - replays[0] > args.iters else \
                "mixed graph" if runner.num_mixed_replays - replays[1] >= args.iters else "eager"
            rows.append({"batch": batch, "drafts": d, "ms": ms, "over_plain": ms / plain,
                         "path": path})
            print(f"B={batch:3d} d={d}: {ms:7.3f} ms  x{ms / plain:5.2f}  ({path})")
    return {"model": args.model, "context_len": args.context_len,
            "token_sizes": cuda_graphs.TOKEN_SIZES, "rows": rows}


# ---- through HTTP ------------------------------------------------------------------------

def prompts(n: int, seed: int = 0, max_id: int = 30000) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(max_id // 30, max_id) for _ in range(rng.randint(8, 32))]
        out.append((phrase * 8)[:rng.randint(128, 256)])
    return out


async def _stream(session, url: str, prompt: list[int], max_tokens: int,
                  temperature: float) -> tuple[int, float]:
    """(output tokens, seconds from the first to the last) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event[event.find(b"data: ") + 6:]
                if not data.startswith(b"{"):
                    continue
                body = json.loads(data)
                if body.get("usage"):
                    tokens = body["usage"]["completion_tokens"]
                if body.get("choices") and body["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
    return tokens, (last - first) if first else 0.0


def _spec_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^orca:spec_decode_{name}_total\{{.*\}} (\S+)$", text, re.M)
        found[name] = float(m.group(1)) if m else 0.0
    return found


async def _load(url: str, args) -> list[dict]:
    import aiohttp

    from load_tests.bench_http import _wait_healthy
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await _wait_healthy(session, url)
        await asyncio.gather(*[_stream(session, url, p, 16, 0.0) for p in prompts(4, 99, args.max_token_id)])
        for temperature in args.temperatures:
            for c in args.concurrency:
                before = _spec_counters(url)
                todo = prompts(c * args.requests, c, args.max_token_id)

                async def client(mine):
                    return [await _stream(session, url, p, args.output_len, temperature)
                            for p in mine]

                start = time.perf_counter()
                done = await asyncio.gather(*[client(todo[i::c]) for i in range(c)])
                elapsed = time.perf_counter() - start
                results = [r for rs in done for r in rs]
                after = _spec_counters(url)
                tokens = sum(n for n, _ in results)
                tpot = statistics.median(s / (n - 1) for n, s in results if n > 1)
                drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                rows.append({"temperature": temperature, "concurrency": c,
                             "tokens_per_s": tokens / elapsed, "tpot_ms": tpot * 1e3,
                             "draft_tokens": drafted, "accepted_tokens": accepted,
                             "accepted_per_output_token": accepted / max(tokens, 1)})
                print(f"  T={temperature} C={c:3d}: {tokens / elapsed:8.1f} tok/s, TPOT "
                      f"{tpot * 1e3:6.2f} ms, drafts {drafted:.0f}, accepted {accepted:.0f}")
    return rows


def run_http(args) -> dict:
    from load_tests.bench_http import launched
    base = {"model": args.model, "enable_prefix_caching": False,
            "max_batch_size": max(args.concurrency)}
    servers = {"default": {}, "async-off": {"async_scheduling": False},
               "spec": {"speculative_config": json.loads(args.spec)}}
    report = {"model": args.model, "output_len": args.output_len, "spec": args.spec,
              "servers": {}}
    for name in args.servers:
        print(name)
        log = f"/tmp/bench-spec-{name}.log"
        with launched({**base, **servers[name]}, port=args.port, log=log):
            report["servers"][name] = asyncio.run(_load(f"http://127.0.0.1:{args.port}",
                                                        args))
        with open(log) as f:  # its start, phase by phase (CUDA graphs among them)
            report[f"{name}_ready"] = next((line.strip() for line in f
                                            if "engine ready" in line), None)
        print(report[f"{name}_ready"])
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=["steps", "http"])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--max-step-tokens", type=int, default=4096,
                   help="mixed-step graphs up to this many tokens (the server's "
                        "max_num_batched_tokens)")
    p.add_argument("--token-sizes", default="",
                   help="the mixed-step graphs' token buckets, e.g. 16,32,64,128,256")
    p.add_argument("--servers", nargs="+", default=["default", "async-off", "spec"])
    p.add_argument("--spec", default=json.dumps(SPEC), help="speculative_config, as JSON")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--requests", type=int, default=2, help="per client")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-token-id", type=int, default=30000, help="prompts' ids below it")
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = run_steps(args) if args.what == "steps" else run_http(args)
    print(json.dumps(report, indent=2))
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
