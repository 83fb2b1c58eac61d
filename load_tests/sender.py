"""How the load client (load_client.py) sends: one streamed completion, a conversation's
turns, a run's plan of arrivals in one process or dealt to several.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import aconnect_sse
from tqdm import tqdm

from load_tests.metrics import SLO, RequestOutcome
from load_tests.traces import TraceRequest


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
    processes: int = 1  # client processes sharing each run (see send_in_processes)
    keep_samples: bool = False  # each request's TTFT and normalized latency in the result


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


def make_client(cfg: LoadConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    timeout = httpx.Timeout(30.0, read=cfg.drain_timeout_s)
    return httpx.AsyncClient(base_url=cfg.url, limits=limits, timeout=timeout)


# how long after the call the processes' common start is: time to spawn and import
PROCESS_START_S = 5.0


async def send_in_processes(cfg: LoadConfig, plan: list) -> tuple[list, int, float, float]:
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
    """One process's share of a plan (see send_in_processes). Before the start it opens
    connections, as the single-process client has them from its warm-up and earlier rates."""
    async def go():
        async with make_client(cfg) as client:
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
