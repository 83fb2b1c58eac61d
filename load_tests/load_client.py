"""Load generator over the OpenAI HTTP API, for orca-serve and for the transformers
baselines behind load_tests/hf_server.py (the same client, so curves compare directly).

    python -m load_tests.load_client --url http://127.0.0.1:8000 --system orca \\
        --trace sharegpt --rates 1,2,4,8,16 --duration 60 --out results/orca.json

Every request is POST /v1/completions with the trace's token ids as the prompt,
max_tokens from the trace, `ignore_eos: true` (so each yields exactly max_tokens tokens),
greedy, `stream: true` with usage. Requests arrive with gamma-distributed gaps at each
offered rate (Poisson with --burstiness 1), cycling through the trace, for --duration
seconds (or --max-requests); the client then waits for the last answers (--drain-timeout)
before the next rate. --rates trace replays the trace's own arrival times. A few warm-up
requests go first and are not measured. After every rate the JSON report is rewritten, so
an interrupted sweep keeps what it measured. Metrics: load_tests/metrics.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from httpx_sse import aconnect_sse
from tqdm import tqdm

from load_tests.metrics import SLO, RequestOutcome, summarize
from load_tests.traces import TraceRequest, arrival_times, make_trace


class WarmupFailed(RuntimeError):
    """No warm-up request succeeded: measuring would only record failures."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    model: str | None = None
    temperature: float = 0.0
    duration_s: float = 60.0
    max_requests: int | None = None
    burstiness: float = 1.0
    seed: int = 0
    num_warmup: int = 8
    drain_timeout_s: float = 600.0
    slo: SLO = field(default_factory=SLO)
    show_progress: bool = True
    processes: int = 1  # client processes sharing each run (see _send_in_processes)


async def send_request(client: httpx.AsyncClient, cfg: LoadConfig, req: TraceRequest,
                       answer: list[int] | None = None) -> RequestOutcome:
    """One streamed completion, timed from just before it is sent. `answer`, if given,
    receives the generated token ids (vLLM's return_token_ids)."""
    body = {"prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "ignore_eos": True,
            "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if answer is not None:
        body["return_token_ids"] = True
    if cfg.model is not None:
        body["model"] = cfg.model
    o = RequestOutcome(len(req.prompt_token_ids), req.max_tokens, req.deadline_s)
    num_chunks, usage_tokens, last = 0, None, None
    start = time.perf_counter()
    try:
        async with aconnect_sse(client, "POST", "/v1/completions", json=body) as events:
            resp = events.response
            if resp.status_code != 200:  # an error object, not events
                o.error = _http_error(resp.status_code, await resp.aread())
                return o
            async for sse in events.aiter_sse():
                if sse.data == "[DONE]":
                    break
                event = json.loads(sse.data)
                if "error" in event:
                    o.error = str(event["error"].get("message", event["error"]))
                    return o
                now = time.perf_counter()
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    o.num_cached_tokens = (event["usage"].get("prompt_tokens_details")
                                           or {}).get("cached_tokens", 0)
                if answer is not None:
                    for c in event.get("choices") or []:
                        answer.extend(c.get("token_ids") or [])
                if any(c.get("text") for c in event.get("choices") or []):
                    if last is None:
                        o.ttft_s = now - start
                    else:
                        o.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
    except (httpx.HTTPError, ValueError) as e:  # httpx-sse's SSEError is an HTTPError
        o.error = f"{type(e).__name__}: {e}"
        return o
    o.end_s = time.perf_counter()
    o.latency_s = o.end_s - start
    if last is None:
        o.error = "no text was streamed"
        return o
    o.num_output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    o.is_success = True
    return o


def _http_error(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"


def schedule(trace: list, rate: float | str, cfg: LoadConfig) -> list[tuple[float, Any]]:
    """(offset s, request) pairs of one run: the trace (requests, or conversations) cycled
    at `rate` within the duration."""
    if rate == "trace":
        if isinstance(trace[0], list):
            raise ValueError("a multi-turn trace has no arrival times to replay")
        pairs = [(r.arrival_s, r) for r in trace]
    else:
        n = cfg.max_requests or (len(trace) if math.isinf(rate)
                                 else max(1, math.ceil(rate * cfg.duration_s)))
        offsets = arrival_times(n, rate, cfg.burstiness, cfg.seed)
        pairs = [(t, trace[i % len(trace)]) for i, t in enumerate(offsets)]
    kept = [(t, r) for t, r in pairs if t <= cfg.duration_s]
    return (kept or pairs[:1])[:cfg.max_requests or None]


def conversations(trace: list[TraceRequest]) -> list[list[TraceRequest]]:
    """A multi-turn trace's turns grouped by conversation, in order."""
    groups: dict[int, list[TraceRequest]] = {}
    for r in trace:
        groups.setdefault(r.conversation, []).append(r)
    return list(groups.values())


async def run_conversation(client: httpx.AsyncClient, cfg: LoadConfig,
                           turns: list[TraceRequest], bar) -> list[RequestOutcome]:
    """The turns one after another, each sent when the previous answer arrived, its prompt
    the whole history (earlier prompts and answers) plus its own message."""
    history: list[int] = []
    outcomes = []
    for turn in turns:
        answer: list[int] = []
        prompt = history + turn.prompt_token_ids
        outcomes.append(await send_request(client, cfg, TraceRequest(prompt, turn.max_tokens),
                                           answer))
        bar.update(1)
        if not outcomes[-1].is_success:
            break
        if len(answer) != outcomes[-1].num_output_tokens:
            outcomes[-1].is_success = False
            outcomes[-1].error = "the server did not return the answer's token ids"
            break
        history = prompt + answer
    return outcomes


async def run_rate(client: httpx.AsyncClient, cfg: LoadConfig, trace: list[TraceRequest],
                   rate: float | str) -> dict:
    """Offer `rate` requests/s (conversations/s for a multi-turn trace) for the configured
    duration; the run's metrics."""
    units = conversations(trace) if trace[0].conversation is not None else trace
    plan = schedule(units, rate, cfg)
    if cfg.processes > 1:
        results, num_pending, start, end = await _send_in_processes(cfg, plan)
    else:
        size = sum(len(u) if isinstance(u, list) else 1 for _, u in plan)
        with tqdm(total=size, desc=f"rate {rate}", unit="req",
                  disable=not cfg.show_progress) as bar:
            start = time.perf_counter()
            results, num_pending, end = await send_plan(client, cfg, plan, start, bar)
    outcomes = []
    for result, (_, unit) in zip(results, plan):
        for i, req in enumerate(unit if isinstance(unit, list) else [unit]):
            got = result if isinstance(result, list) else [result] if result else []
            if i < len(got):
                outcomes.append(got[i])
            else:
                why = "unfinished at drain timeout" if result is None else \
                    "not sent: an earlier turn of its conversation failed"
                outcomes.append(RequestOutcome(len(req.prompt_token_ids), req.max_tokens,
                                               req.deadline_s, error=why))
    ends = [o.end_s for o in outcomes if o.is_success]
    duration = (max(ends) if ends and not num_pending else end) - start
    result = {"rate": rate if isinstance(rate, str) or math.isfinite(rate) else "inf",
              "burstiness": cfg.burstiness}
    result.update(summarize(outcomes, duration, cfg.slo))
    return result


async def send_plan(client: httpx.AsyncClient, cfg: LoadConfig, plan: list[tuple[float, Any]],
                    start: float, bar) -> tuple[list, int, float]:
    """Each unit of the plan sent at start + its offset (perf_counter time); per unit its
    outcome (a list for a conversation), None if unfinished at the drain timeout; how many
    were unfinished; and when the last one ended or was given up."""
    tasks = []
    for offset, unit in plan:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if isinstance(unit, list):
            task = asyncio.create_task(run_conversation(client, cfg, unit, bar))
        else:
            task = asyncio.create_task(send_request(client, cfg, unit))
            task.add_done_callback(lambda _: bar.update(1))
        tasks.append(task)
    if not tasks:
        return [], 0, time.perf_counter()
    done, pending = await asyncio.wait(tasks, timeout=cfg.drain_timeout_s)
    end = time.perf_counter()
    for task in pending:
        task.cancel()
    return [task.result() if task in done else None for task in tasks], len(pending), end


def _client(cfg: LoadConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    timeout = httpx.Timeout(30.0, read=cfg.drain_timeout_s)
    return httpx.AsyncClient(base_url=cfg.url, limits=limits, timeout=timeout)


# how long after the call the processes' common start is: time to spawn and import
PROCESS_START_S = 5.0


async def _send_in_processes(cfg: LoadConfig, plan: list) -> tuple[list, int, float, float]:
    """The plan dealt round-robin to cfg.processes processes, each with its own event loop
    and connections, all timed from one start (perf_counter is CLOCK_MONOTONIC, shared by
    every process): one Python process parsing every streamed event caps the load it can
    offer and delays what it measures (~50-70 us of its CPU per event)."""
    n = cfg.processes
    start = time.perf_counter() + PROCESS_START_S
    parts = [plan[i::n] for i in range(n)]
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        outs = await asyncio.gather(*[loop.run_in_executor(pool, _send_part, cfg, part, start)
                                      for part in parts])
    results: list = [None] * len(plan)
    for i, (part_results, _, _) in enumerate(outs):
        results[i::n] = part_results
    return results, sum(o[1] for o in outs), start, max(o[2] for o in outs)


def _send_part(cfg: LoadConfig, part: list, start: float) -> tuple[list, int, float]:
    """One process's share of a plan (see _send_in_processes). Before the start it opens
    connections, as the single-process client has them from its warm-up and earlier rates."""
    async def go():
        async with _client(cfg) as client:
            await _open_connections(client, min(len(part), CONNECTIONS_PER_PROCESS))
            late = time.perf_counter() - start
            if late > 0:
                print(f"load_client: a client process started {late:.2f} s late; its first "
                      "requests go out at once", file=sys.stderr)
            return await send_plan(client, cfg, part, start, tqdm(disable=True))

    return asyncio.run(go())


CONNECTIONS_PER_PROCESS = 64


async def _open_connections(client: httpx.AsyncClient, n: int) -> None:
    """n connections in the client's pool: n requests at once (GET /v1/models; any answer
    keeps its connection open)."""
    async def one():
        try:
            await client.get("/v1/models")
        except httpx.HTTPError:
            pass

    await asyncio.gather(*[one() for _ in range(n)])


async def sweep(cfg: LoadConfig, trace: list[TraceRequest], rates: list[float | str],
                on_result=None) -> list[dict]:
    """Warm up once, then one run per rate; `on_result(results so far)` after each."""
    results: list[dict] = []
    async with _client(cfg) as client:
        if cfg.num_warmup:
            # Reversed prompts: the same shapes, but nothing a prefix cache could reuse later.
            warm_reqs = [TraceRequest(trace[i % len(trace)].prompt_token_ids[::-1],
                                      trace[i % len(trace)].max_tokens)
                         for i in range(cfg.num_warmup)]
            warm = await asyncio.gather(*(send_request(client, cfg, r) for r in warm_reqs))
            failed = [o.error for o in warm if not o.is_success]
            if len(failed) == len(warm):
                raise WarmupFailed(f"every warm-up request failed; first error: {failed[0]}")
        for rate in rates:
            results.append(await run_rate(client, cfg, trace, rate))
            if on_result is not None:
                on_result(results)
    return results


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_rates(text: str) -> list[float | str]:
    """'1,2,4' -> [1.0, 2.0, 4.0]; 'inf' sends everything at once; 'trace' replays arrivals."""
    rates: list[float | str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "trace":
            rates.append(part)
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad rate {part!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"rates must be positive, got {part}")
        rates.append(value)
    return rates


def main(argv: list[str] | None = None) -> list[dict]:
    from load_tests.report import markdown_table

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--system", default="orca", help="label of this system in reports/plots")
    p.add_argument("--model", help="`model` field to send (default: none)")
    p.add_argument("--trace", default="sharegpt",
                   help="orca, tcb, sharegpt, shared-prefix, multi-turn or a .jsonl file")
    p.add_argument("--prefix-len", type=int, default=2000,
                   help="shared-prefix: length of the shared system prompt")
    p.add_argument("--turns", type=int, default=5, help="multi-turn: turns per conversation "
                   "(--rates are then conversations started per second)")
    p.add_argument("--num-prompts", type=int, default=1000, help="size of a generated trace")
    p.add_argument("--vocab-size", type=int, default=256,
                   help="prompt ids are drawn below this (256 fits every model here)")
    p.add_argument("--max-context", type=int, default=2048, help="sharegpt length cap")
    p.add_argument("--tcb-variance", type=float, default=20.0)
    p.add_argument("--tcb-rate", type=float, default=100.0,
                   help="Poisson rate baked into a generated tcb trace (for --rates trace)")
    p.add_argument("--tcb-per-token-ms", type=float, default=20.0, help="tcb deadline unit")
    p.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,8"),
                   help="offered request rates, req/s, comma-separated (or inf, trace)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--max-requests", type=int, help="cap on requests per rate")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured requests first")
    p.add_argument("--drain-timeout", type=float, default=600.0,
                   help="seconds to wait for the last answers of a rate")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--out", help="JSON report (rewritten after every rate)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--processes", type=positive_int, default=1,
                   help="client processes sharing each run (one parsed ~14k streamed "
                   "events/s on a 2-core CPU machine)")
    args = p.parse_args(argv)

    trace = make_trace(args.trace, args.num_prompts, args.vocab_size, args.seed,
                       rate=args.tcb_rate, variance=args.tcb_variance, per_token_s=args.tcb_per_token_ms / 1e3,
                       max_context=args.max_context, prefix_len=args.prefix_len,
                       turns=args.turns)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    cfg = LoadConfig(args.url.rstrip("/"), args.model, args.temperature, args.duration,
                     args.max_requests, args.burstiness, args.seed, args.warmup,
                     args.drain_timeout, slo, not args.no_progress, args.processes)
    report = {"system": args.system, "url": cfg.url, "model": args.model,
              "trace": {"name": args.trace, "num_prompts": len(trace), "seed": args.seed,
                        "vocab_size": args.vocab_size, "prefix_len": args.prefix_len,
                        "turns": args.turns},
              "config": {k: v for k, v in asdict(cfg).items() if k not in ("url", "model")},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}

    def save(results: list[dict]) -> None:
        report["runs"] = results
        print(markdown_table([{**report, "runs": results[-1:]}]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)

    try:
        return asyncio.run(sweep(cfg, trace, args.rates, save))
    except WarmupFailed as e:
        raise SystemExit(f"load_client: {e} (is the server at {cfg.url} up?)") from None


if __name__ == "__main__":
    main()
