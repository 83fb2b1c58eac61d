"""Discrete-event simulation of the engine's scheduling: the real Scheduler, policy and
KVCacheManager, with a calibrated cost model (load_tests/cost_model.py) in place of workers.

    python -m load_tests.simulator --trace tcb --variance 100 --rates 40,80,120 \\
        --policies fcfs,priority,das,sjf,edf --cost-model cost_model_cpu.json --out-dir DIR

The virtual clock starts at the first arrival. Every iteration: requests whose arrival time
the clock has passed join the pool, `expire(now)` drops those whose start-by deadline has
passed, `schedule()` builds the batch, the clock advances by the cost model's time for
that step, and `process` applies one fake token per sampling row. Requests ignore EOS, so
each generates exactly max_tokens. One step at a time: the simulated engine is the scheduler
actor with async_scheduling off (one step in flight, no continuation), and the calibration
folds the actor's control-plane time into the step cost. When nothing can run, the clock
jumps to the next arrival.

Why simulate: a policy comparison needs many rates x policies x long traces; the simulator
runs exactly the policy code that serves, so what it ranks is what the engine would do
under this cost model. The validation (load_tests/validate_simulator.py) compares it with
the real engine.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import asdict, dataclass

from engine_actors.config import EngineConfig
from engine_actors.kv_cache import cdiv
from engine_actors.policies import Policy
from engine_actors.request import Request, SamplingParams
from engine_actors.scheduler import RequestRejected, Scheduler
from load_tests.cost_model import CostModel, step_features
from load_tests.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The scheduling configuration the simulation mirrors (EngineConfig's arguments)."""
    max_batch_size: int = 32
    max_num_batched_tokens: int = 256
    max_num_tokens: int = 16384  # KV cache capacity in tokens
    block_size: int = 16
    max_model_len: int = 4096

    def engine_args(self, policy: str, model: str = "tiny-random-llama",
                    device: str = "cpu") -> dict:
        """The same configuration for the real engine (one step in flight)."""
        return dict(model=model, device=device, scheduling_policy=policy,
                    max_batch_size=self.max_batch_size,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    max_num_tokens=self.max_num_tokens, block_size=self.block_size,
                    async_scheduling=False)


DEFAULT_SPEC = EngineSpec()


@dataclass(slots=True)
class SimOutcome:
    prompt_len: int
    max_tokens: int
    arrival_s: float
    deadline_s: float | None  # absolute start-by time; None: no deadline
    start_s: float | None = None  # first scheduled
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None  # length, deadline (expired), rejected
    num_generated: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class SimResult:
    outcomes: list[SimOutcome]
    num_steps: int
    num_preemptions: int
    busy_s: float  # simulated time spent in steps
    end_s: float  # clock when the last request left


def simulate(trace: list[TraceRequest], policy: str | Policy, spec: EngineSpec,
             cost: CostModel) -> SimResult:
    """Run `trace` through the real scheduler under `policy` (a scheduling_policy name, or a
    Policy object for experiments); see the module docstring."""
    cfg = EngineConfig.from_args(spec.engine_args(policy if isinstance(policy, str) else "fcfs"))
    sched = Scheduler.from_config(cfg, cdiv(spec.max_num_tokens, spec.block_size),
                                  spec.max_model_len, eos_token_ids=(),
                                  policy=None if isinstance(policy, str) else policy)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    outcomes = [SimOutcome(len(r.prompt_token_ids), r.max_tokens, r.arrival_s,
                           None if r.deadline_s is None else r.arrival_s + r.deadline_s)
                for r in trace]
    requests: dict[str, Request] = {}
    clock = trace[order[0]].arrival_s if trace else 0.0
    busy, num_steps, nxt = 0.0, 0, 0

    def finish(rid: str, reason: str) -> None:
        o = outcomes[int(rid)]
        o.finish_s, o.finish_reason = clock, reason
        req = requests.pop(rid, None)
        if req is not None:
            o.num_preemptions = req.num_preemptions

    while nxt < len(order) or sched.pool:
        while nxt < len(order) and trace[order[nxt]].arrival_s <= clock:
            i = order[nxt]
            nxt += 1
            r, o = trace[i], outcomes[i]
            req = Request(str(i), list(r.prompt_token_ids),
                          SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                          r.arrival_s,
                          deadline=o.deadline_s if o.deadline_s is not None else float("inf"))
            try:
                sched.add(req)
            except RequestRejected:
                o.finish_s, o.finish_reason = clock, "rejected"
                continue
            requests[req.request_id] = req
        for out in sched.expire(clock):
            finish(out.request_id, out.finish_reason)
        batch = sched.schedule()
        if batch is None:
            if nxt < len(order):
                clock = max(clock, trace[order[nxt]].arrival_s)
                continue
            if not sched.pool:  # the last ones just expired
                break
            raise RuntimeError(f"{policy}: {len(sched.pool)} requests left but none can run")
        for item in batch.scheduled:
            o = outcomes[int(item.request.request_id)]
            if o.start_s is None:
                o.start_s = clock
        dt = cost.step_time(step_features(batch.step))
        clock += dt
        busy += dt
        num_steps += 1
        for out in sched.process(batch, [0] * sum(batch.step.sample)):
            o = outcomes[int(out.request_id)]
            if out.new_token_ids and o.first_token_s is None:
                o.first_token_s = clock
            o.num_generated += len(out.new_token_ids)
            if out.finish_reason is not None:
                finish(out.request_id, out.finish_reason)
    return SimResult(outcomes, num_steps, sched.num_preemptions, busy, clock)


def main(argv: list[str] | None = None) -> dict:
    from load_tests.policy_report import sweep_report, write_outputs
    from load_tests.policy_traces import (
        WORKLOADS,
        capacity_estimate,
        unloaded_per_token_s,
        workload,
    )
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", choices=WORKLOADS, default="tcb")
    p.add_argument("--variance", type=float, default=20.0, help="tcb: length variance")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", help="req/s, comma-separated; default: 0.25-3x the estimated "
                                   "capacity under the cost model")
    p.add_argument("--policies", default="fcfs,priority,das,sjf,edf")
    p.add_argument("--cost-model", required=True, help="JSON from load_tests.cost_model")
    p.add_argument("--max-batch-size", type=int, default=DEFAULT_SPEC.max_batch_size)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=DEFAULT_SPEC.max_num_batched_tokens)
    p.add_argument("--max-num-tokens", type=int, default=DEFAULT_SPEC.max_num_tokens,
                   help="KV cache capacity in tokens")
    p.add_argument("--block-size", type=int, default=DEFAULT_SPEC.block_size)
    p.add_argument("--per-token-ms", type=float,
                   help="deadline unit; default: the cost model's unloaded time per token")
    p.add_argument("--label", help="file name stem (default: trace and variance)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)

    cost = CostModel.load(args.cost_model)
    spec = EngineSpec(args.max_batch_size, args.max_num_batched_tokens, args.max_num_tokens,
                      args.block_size)
    per_token_s = (args.per_token_ms / 1e3 if args.per_token_ms
                   else unloaded_per_token_s(cost))
    capacity = capacity_estimate(cost, spec.max_batch_size, workload(
        args.trace, args.num_requests, 1.0, per_token_s, args.seed, args.variance))
    rates = ([float(r) for r in args.rates.split(",")] if args.rates else
             [round(capacity * m, 1) for m in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)])
    policies = args.policies.split(",")
    runs = []
    for rate in rates:
        trace = workload(args.trace, args.num_requests, rate, per_token_s, args.seed,
                         args.variance)
        for policy in policies:
            runs.append({"rate": rate, "policy": policy,
                         **sweep_report(simulate(trace, policy, spec, cost))})
            print(f"rate {rate:8.1f}  {policy:8s}  utility {runs[-1]['utility']:.3f}  "
                  f"hit {runs[-1]['hit_ratio']:.3f}  req/s {runs[-1]['request_throughput']:.1f}",
                  flush=True)
    label = args.label or (f"{args.trace}-var{args.variance:g}" if args.trace == "tcb"
                           else args.trace)
    report = {"trace": {"name": args.trace, "variance": args.variance if args.trace == "tcb"
                        else None, "num_requests": args.num_requests, "seed": args.seed,
                        "per_token_s": per_token_s, "deadline": "start within slack x "
                        "(prompt + max_tokens) x per_token_s, slack ~ U(1.5, 4)"},
              "engine": asdict(spec), "cost_model": cost.as_dict(),
              "cost_model_file": args.cost_model, "capacity_estimate_rps": capacity,
              "command": "python -m load_tests.simulator " + shlex.join(
                  sys.argv[1:] if argv is None else argv),
              "runs": runs}
    os.makedirs(args.out_dir, exist_ok=True)
    write_outputs(report, args.out_dir, label)
    return report


if __name__ == "__main__":
    main()
