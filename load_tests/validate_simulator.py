"""Does the simulator predict the real engine? The same trace, configuration and policy run
through the real scheduler actor on CPU (tiny model, Ray, requests submitted at their
arrival times) and through the simulator with the calibrated cost model; their throughputs
must agree within 15%, at one rate below and one above the saturation point.

    python -m load_tests.validate_simulator --cost-model cost_model_cpu.json \\
        --out load_tests/results/policies/validation.json

Default rates: 0.5x and 2x the cost model's capacity estimate for the trace; default
policies fcfs and das, each in a fresh engine. The real run uses async_scheduling off (one
step in flight), as the simulator models it. Arrival times on the real side are the
driver's submission times, a request's deadline counts from the actor's receipt of it.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys

from load_tests.cost_model import CostModel
from load_tests.engine_replay import EngineOutcome, LocalEngine, replay
from load_tests.policy_report import sweep_report
from load_tests.policy_traces import capacity_estimate, unloaded_per_token_s, workload
from load_tests.simulator import EngineSpec, SimOutcome, SimResult, simulate

TOLERANCE = 0.15
COMPARED = ("request_throughput", "token_throughput", "utility", "hit_ratio", "completed",
            "num_steps", "num_preemptions")


def real_result(trace, outcomes: list[EngineOutcome], stats_before: dict,
                stats_after: dict) -> SimResult:
    """The real run in the simulator's terms. Times are the driver's: arrival = submission,
    a request counts as started when it produced a token."""
    sims = []
    for r, o in zip(trace, outcomes):
        if o.refusal is not None:
            raise RuntimeError(f"the engine refused a trace request: {o.refusal}")
        sims.append(SimOutcome(len(r.prompt_token_ids), r.max_tokens, o.submit_s, None,
                               start_s=o.first_token_s, first_token_s=o.first_token_s,
                               finish_s=o.finish_s, finish_reason=o.finish_reason,
                               num_generated=o.num_generated))
    end = max(o.finish_s for o in sims if o.finish_s is not None)
    return SimResult(sims, stats_after["num_steps"] - stats_before["num_steps"],
                     stats_after["num_preemptions"] - stats_before["num_preemptions"],
                     busy_s=0.0, end_s=end)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", required=True)
    p.add_argument("--policies", default="fcfs,das", help="each validated at both rates")
    p.add_argument("--trace", default="tcb", choices=["tcb", "orca"])
    p.add_argument("--variance", type=float, default=100.0)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", help="two rates (req/s), comma-separated; default 0.5x and 2x "
                                   "the capacity estimate")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    cost = CostModel.load(args.cost_model)
    spec = EngineSpec()
    per_token_s = unloaded_per_token_s(cost)
    capacity = capacity_estimate(cost, spec.max_batch_size, workload(
        args.trace, args.num_requests, 1.0, per_token_s, args.seed, args.variance))
    rates = ([float(r) for r in args.rates.split(",")] if args.rates
             else [round(0.5 * capacity, 1), round(2.0 * capacity, 1)])
    traces = {rate: workload(args.trace, args.num_requests, rate, per_token_s, args.seed,
                             args.variance) for rate in rates}
    results = []
    for policy in args.policies.split(","):
        results += validate(policy, spec, cost, traces, warmup=workload(
            args.trace, 64, capacity, per_token_s, args.seed + 1, args.variance))
    report = {"trace": {"name": args.trace, "variance": args.variance,
                        "num_requests": args.num_requests, "seed": args.seed,
                        "per_token_s": per_token_s},
              "engine_args": spec.engine_args("<policy>"), "cost_model": cost.as_dict(),
              "cost_model_file": args.cost_model, "capacity_estimate_rps": capacity,
              "tolerance": TOLERANCE, "results": results,
              "passed": all(r["within_tolerance"] for r in results),
              "command": "python -m load_tests.validate_simulator " + shlex.join(
                  sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return report


def validate(policy: str, spec: EngineSpec, cost: CostModel, traces: dict, warmup) -> list[dict]:
    """Each trace through one real engine (a fresh one per policy) and the simulator."""
    import ray
    results = []
    with LocalEngine(spec.engine_args(policy)) as actor:
        asyncio.run(replay(actor, warmup))
        for rate, trace in traces.items():
            before = ray.get(actor.stats.remote())
            outcomes = asyncio.run(replay(actor, trace))
            after = ray.get(actor.stats.remote())
            real = sweep_report(real_result(trace, outcomes, before, after))
            sim = sweep_report(simulate(trace, policy, spec, cost))
            diff = (sim["request_throughput"] - real["request_throughput"]) \
                / real["request_throughput"]
            results.append({
                "policy": policy, "rate": rate, "real": {k: real[k] for k in COMPARED},
                "sim": {k: sim[k] for k in COMPARED},
                "real_normalized_latency_ms": real["normalized_latency_ms"],
                "sim_normalized_latency_ms": sim["normalized_latency_ms"],
                "throughput_rel_diff": diff, "within_tolerance": abs(diff) <= TOLERANCE})
            print(f"{policy} at {rate} req/s: real {real['request_throughput']:.2f} req/s, "
                  f"sim {sim['request_throughput']:.2f} req/s ({diff:+.1%})", flush=True)
    return results


if __name__ == "__main__":
    main()
