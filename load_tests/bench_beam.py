"""Beam search through HTTP against sampling the same number of choices, on one server.

    python -m load_tests.bench_beam --model llama-8b --widths 2 4 --max-tokens 32

Beam search (`use_beam_search`, deployments/beam_search.py) runs every step as engine
requests of one token, so each output token costs a trip from the ingress replica through
the scheduler and back, where sampling `n` choices streams them from running requests. For
each width W this sends completions requests with `n` = W, sampled (temperature 1, EOS
ignored) and then as beam search (EOS ignored, so every beam runs `--max-tokens` steps):
  - `--sequential` requests one after another: the latency of one request;
  - `--concurrent` requests at once: the wall time of the batch.
Prompts never repeat across requests (the prefix cache helps only within one search).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from load_tests.bench_http import _wait_healthy, launched
from load_tests.report import save_json


async def one(session, url: str, body: dict) -> float:
    started = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
    assert all(c["finish_reason"] == "length" for c in data["choices"]), data
    return time.perf_counter() - started


async def run(args) -> list[dict]:
    import aiohttp
    url = f"http://127.0.0.1:{args.port}"
    rows, count = [], 0
    with launched({"model": args.model, "device": args.device}, port=args.port):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            await _wait_healthy(s, url)

            def body(width: int, beam: bool) -> dict:
                nonlocal count
                count += 1
                words = " ".join(f"w{count}-{i}" for i in range(args.prompt_words))
                return {"prompt": words, "n": width, "max_tokens": args.max_tokens,
                        "ignore_eos": True, "temperature": 1.0, "use_beam_search": beam}
            await one(s, url, body(2, True))  # warm-up: both paths, compiled and cached
            await one(s, url, body(2, False))
            for width in args.widths:
                for beam in (False, True):
                    alone = [await one(s, url, body(width, beam)) for _ in range(args.sequential)]
                    started = time.perf_counter()
                    await asyncio.gather(*(one(s, url, body(width, beam))
                                           for _ in range(args.concurrent)))
                    wall = time.perf_counter() - started
                    row = {"width": width, "mode": "beam" if beam else "sample",
                           "latency_p50_s": statistics.median(alone),
                           "ms_per_step": statistics.median(alone) / args.max_tokens * 1e3,
                           "concurrent_wall_s": wall,
                           "concurrent_tokens_per_s":
                               args.concurrent * width * args.max_tokens / wall}
                    rows.append(row)
                    print(f"W {width}  {row['mode']:6}  one request p50 "
                          f"{row['latency_p50_s'] * 1e3:8.1f} ms ({row['ms_per_step']:5.1f} ms "
                          f"a token)  {args.concurrent} at once {wall:6.2f} s "
                          f"({row['concurrent_tokens_per_s']:7.0f} tokens/s)", flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--sequential", type=int, default=5)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = {"model": args.model, "max_tokens": args.max_tokens,
              "prompt_words": args.prompt_words, "rows": asyncio.run(run(args))}
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
