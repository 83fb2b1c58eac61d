"""Multi-turn conversations through HTTP: the Responses API continued from the stored
response (`previous_response_id`) against the whole conversation sent every turn, and the
same conversations on chat completions, one after another on one server.

    python -m load_tests.bench_conversations --model llama-1b --out conversations.json

Modes:
  chained   POST /v1/responses with previous_response_id and the new user message (the
            server keeps every response: store, the default)
  full      POST /v1/responses with every earlier message as input items, store false
  chat      POST /v1/chat/completions with every earlier message
--conversations run at once, each --turns turns: a turn sends a user message of --words
words and waits for the answer (greedy, EOS ignored, --max-tokens tokens, not streamed).
Prefix caching is off, so no mode finds another's prompts cached. Every mode renders the
same prompts (the answers come back as text and go into the next turn's template), so
greedy answers must be equal across modes: the run checks it on one conversation run
alone in each mode first (alone, its steps' batches are the same in every mode). Reported
per mode: turn latency p50/p99, the run's wall time, and the mean request body size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from load_tests.bench_http import _wait_healthy, launched
from load_tests.report import save_json

MODES = ("chained", "full", "chat")
WORDS = ("orca whale river stone cloud paper light green quick seven field table north "
         "music bread glass clock honey metal sugar").split()


def user_text(conversation: int, turn: int, words: int) -> str:
    rng = random.Random(conversation * 1000 + turn)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def converse(session, url: str, mode: str, conversation: int, args) -> dict:
    history: list[dict] = []  # chat messages so far
    previous = None
    latencies, sizes, answers = [], [], []
    for turn in range(args.turns):
        message = {"role": "user", "content": user_text(conversation, turn, args.words)}
        common = {"temperature": 0, "ignore_eos": True}  # the served model
        if mode == "chat":
            route = "/v1/chat/completions"
            body = {**common, "messages": history + [message], "max_tokens": args.max_tokens}
        elif mode == "full":
            route = "/v1/responses"
            body = {**common, "input": history + [message], "store": False,
                    "max_output_tokens": args.max_tokens}
        else:
            route = "/v1/responses"
            body = {**common, "input": [message], "max_output_tokens": args.max_tokens}
            if previous is not None:
                body["previous_response_id"] = previous
        data = json.dumps(body)
        started = time.perf_counter()
        async with session.post(url + route, data=data,
                                headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"{mode} turn {turn}: HTTP {r.status}: {await r.text()}")
            res = await r.json()
        latencies.append(time.perf_counter() - started)
        sizes.append(len(data))
        if mode == "chat":
            answer = res["choices"][0]["message"]["content"]
            tokens = res["usage"]["completion_tokens"]
        else:
            answer = "".join(part["text"] for item in res["output"] if item["type"] == "message"
                             for part in item["content"])
            tokens = res["usage"]["output_tokens"]
            previous = res["id"]
        if tokens != args.max_tokens:
            raise RuntimeError(f"{mode} turn {turn}: {tokens} tokens, not {args.max_tokens}")
        answers.append(answer)
        history += [message, {"role": "assistant", "content": answer}]
    return {"latencies": latencies, "sizes": sizes, "answers": answers}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args) -> dict:
    import aiohttp
    url = f"http://127.0.0.1:{args.port}"
    engine_args = {"model": args.model, "device": args.device, "enable_prefix_caching": False,
                   "max_batch_size": 256}
    results = {}
    with launched(engine_args, args.replicas, args.port):
        timeout = aiohttp.ClientTimeout(total=args.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await _wait_healthy(session, url)
            await converse(session, url, "chained", 10**6, args)  # warm-up
            # the check: one conversation alone per mode, so every step's batch is the same
            # in every mode (in bf16 another batch can flip a random model's near-ties)
            alone = {mode: (await converse(session, url, mode, 0, args))["answers"]
                     for mode in args.modes}
            for mode in args.modes:
                started = time.perf_counter()
                runs = await asyncio.gather(*(converse(session, url, mode, c, args)
                                              for c in range(args.conversations)))
                wall = time.perf_counter() - started
                latencies = [x for r in runs for x in r["latencies"]]
                sizes = [x for r in runs for x in r["sizes"]]
                results[mode] = {"wall_s": wall, "turn_p50_s": percentile(latencies, 0.5),
                                 "turn_p99_s": percentile(latencies, 0.99),
                                 "mean_request_bytes": sum(sizes) / len(sizes),
                                 "answers_equal_first_mode": alone[mode] ==
                                 alone[args.modes[0]]}
    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    results = asyncio.run(run(args))
    report = {"model": args.model, "conversations": args.conversations, "turns": args.turns,
              "words": args.words, "max_tokens": args.max_tokens, "replicas": args.replicas,
              "modes": results}
    print(json.dumps(report, indent=2))
    print(f"{'mode':<8} {'wall s':>7} {'turn p50 ms':>12} {'turn p99 ms':>12} "
          f"{'request B':>10} {'answers = ' + args.modes[0]:>18}")
    for mode, r in results.items():
        print(f"{mode:<8} {r['wall_s']:7.2f} {r['turn_p50_s'] * 1e3:12.1f} "
              f"{r['turn_p99_s'] * 1e3:12.1f} {r['mean_request_bytes']:10.0f} "
              f"{str(r['answers_equal_first_mode']):>18}")
    save_json(args.out, report)
    if not all(r["answers_equal_first_mode"] for r in results.values()):
        raise SystemExit("the modes' greedy answers differ: they rendered different prompts")
    return report


if __name__ == "__main__":
    main()
