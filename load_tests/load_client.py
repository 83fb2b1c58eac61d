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
import math
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx
from tqdm import tqdm

from load_tests.metrics import SLO, RequestOutcome, summarize, worst_ttft_per_second
from load_tests.sender import (LoadConfig, make_client, run_conversation, send_in_processes,
                               send_plan, send_request)
from load_tests.traces import TraceRequest, arrival_times, make_trace
from load_tests.report import save_json

__all__ = ["LoadConfig", "WarmupFailed", "parse_rates", "run_conversation", "schedule",
           "send_request", "sweep"]


class WarmupFailed(RuntimeError):
    """No warm-up request succeeded: measuring would only record failures."""


def schedule(trace: list, rate: float | str, cfg: LoadConfig,
             first: int = 0) -> list[tuple[float, Any]]:
    """(offset s, request) pairs of one run: the trace (requests, or conversations) from
    index `first` on, cycled when it runs out, at `rate` within the duration."""
    if rate == "trace":
        if isinstance(trace[0], list):
            raise ValueError("a multi-turn trace has no arrival times to replay")
        pairs = [(r.arrival_s, r) for r in trace]
    else:
        n = cfg.max_requests or (len(trace) if math.isinf(rate)
                                 else max(1, math.ceil(rate * cfg.duration_s)))
        offsets = arrival_times(n, rate, cfg.burstiness, cfg.seed)
        pairs = [(t, trace[(first + i) % len(trace)]) for i, t in enumerate(offsets)]
    kept = [(t, r) for t, r in pairs if t <= cfg.duration_s]
    return (kept or pairs[:1])[:cfg.max_requests or None]


def conversations(trace: list[TraceRequest]) -> list[list[TraceRequest]]:
    """A multi-turn trace's turns grouped by conversation, in order."""
    groups: dict[int, list[TraceRequest]] = {}
    for r in trace:
        groups.setdefault(r.conversation, []).append(r)
    return list(groups.values())


def units_of(trace: list[TraceRequest]) -> list:
    """What a rate counts: requests, or a multi-turn trace's conversations."""
    return conversations(trace) if trace[0].conversation is not None else trace


def units_needed(rates: list[float | str], cfg: LoadConfig) -> int:
    """Requests (or conversations) that runs at these rates send: a trace this long sends
    each of them once, so that no run repeats a prompt the server's prefix cache holds."""
    return sum(cfg.max_requests or (math.ceil(r * cfg.duration_s) if math.isfinite(r) else 0)
               for r in rates if not isinstance(r, str))


def trace_size(name: str, rates: list[float | str], cfg: LoadConfig, turns: int) -> int:
    """Requests to generate: what the runs send (at least 1000), so that none repeats. A
    replayed trace ("trace" rate) keeps its own length: its arrivals are the workload."""
    needed = 0 if "trace" in rates else units_needed(rates, cfg)
    return max(1000, needed * (turns if name == "multi-turn" else 1))


async def run_rate(client: httpx.AsyncClient, cfg: LoadConfig, units: list, rate: float | str,
                   first: int = 0) -> tuple[dict, int]:
    """Offer `rate` units/s (requests, or a multi-turn trace's conversations: units_of) for
    the configured duration, from unit `first` on; the run's metrics and the units it sent."""
    plan = schedule(units, rate, cfg, first)
    if cfg.processes > 1:
        results, num_pending, start, end = await send_in_processes(cfg, plan)
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
    result["ttft_max_ms_per_s"] = worst_ttft_per_second(outcomes, start)
    if cfg.keep_samples:  # ms, for intervals (metrics.ratio_interval)
        ok = [o for o in outcomes if o.is_success and o.num_output_tokens]
        result["samples_ms"] = {
            "sent_s": [round(o.sent_s - start, 3) for o in ok],  # from the start
            "ttft": [round(o.ttft_s * 1e3, 2) for o in ok],
            "normalized_latency": [round(o.latency_s / o.num_output_tokens * 1e3, 3) for o in ok]}
    return result, len(plan)


async def sweep(cfg: LoadConfig, trace: list[TraceRequest], rates: list[float | str],
                on_result=None) -> list[dict]:
    """Warm up once, then one run per rate, each on the trace's next units (cycled when
    they run out); `on_result(results so far)` after each."""
    results: list[dict] = []
    first, units = 0, units_of(trace)
    async with make_client(cfg) as client:
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
            result, sent = await run_rate(client, cfg, units, rate, first)
            if first + sent > len(units) or (rate == "trace" and first):
                print(f"load_client: the run at rate {rate} sent prompts that were sent before "
                      f"(the trace has {len(units)} requests or conversations): prompts repeat, "
                      "and a server with prefix caching serves the repeats from its cache",
                      file=sys.stderr)
            results.append(result)
            first += sent
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
    p.add_argument("--num-prompts", type=int,
                   help="size of a generated trace (default: what the runs send, at least "
                   "1000, so that no prompt repeats; repeats would hit a prefix cache)")
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

    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    cfg = LoadConfig(args.url.rstrip("/"), args.model, args.temperature, args.duration,
                     args.max_requests, args.burstiness, args.seed, args.warmup,
                     args.drain_timeout, slo, not args.no_progress, args.processes)
    size = args.num_prompts or trace_size(args.trace, args.rates, cfg, args.turns)
    trace = make_trace(args.trace, size, args.vocab_size, args.seed,
                       rate=args.tcb_rate, variance=args.tcb_variance, per_token_s=args.tcb_per_token_ms / 1e3,
                       max_context=args.max_context, prefix_len=args.prefix_len,
                       turns=args.turns)
    report = {"system": args.system, "url": cfg.url, "model": args.model,
              "trace": {"name": args.trace, "num_prompts": len(trace), "seed": args.seed,
                        "vocab_size": args.vocab_size, "prefix_len": args.prefix_len,
                        "turns": args.turns},
              "config": {k: v for k, v in asdict(cfg).items() if k not in ("url", "model")},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}

    def save(results: list[dict]) -> None:
        report["runs"] = results
        print(markdown_table([{**report, "runs": results[-1:]}]), flush=True)
        save_json(args.out, report)

    try:
        return asyncio.run(sweep(cfg, trace, args.rates, save))
    except WarmupFailed as e:
        raise SystemExit(f"load_client: {e} (is the server at {cfg.url} up?)") from None


if __name__ == "__main__":
    main()
