"""Calibrate the iteration cost model (load_tests/cost_model.py) on this engine.

1. Compute: the real ModelRunner, in-process, runs synthetic steps over a grid of (prefill
   requests x prompt length, decode requests x context length); the median of `repeats`
   timed runs of each step is one measurement. The linear model is fitted to them.
2. Control plane: the same steps reach the worker through the scheduler actor and Ray in a
   real deployment. B identical requests (B = 1, 8, 32) run through the actor with one step
   in flight (async_scheduling off, as the simulator models it); the worker's step traces
   give the wall time between consecutive decode iterations. Its excess over the fitted
   compute time of those same steps, fitted as o0 + o_req * B, is folded into c0 and into
   the per-request terms (c_decode, and c_prefill_req when the model has it).

    python -m load_tests.cost_model --out cost_model_cpu.json
    python -m load_tests.cost_model --device cuda --model llama-8b --out cost_h200.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import itertools
import json
import os
import platform
import shlex
import sys
import time

import numpy as np
import torch

from engine_actors.kv_cache import cdiv
from engine_actors.messages import NewRequest, StepInput
from load_tests.cost_model import StepFeatures, model_of, select, step_features

# (prefill requests, prompt lengths, decode requests, decode contexts, max prefill tokens)
GRIDS = {
    "cpu": dict(prefill_requests=[1, 2, 4, 8], prompt_lens=[8, 32, 100, 256],
                decode_requests=[1, 4, 8, 16, 32], contexts=[16, 64, 200, 640],
                max_prefill_tokens=2048),
    "cuda": dict(prefill_requests=[1, 4, 16], prompt_lens=[32, 128, 512, 2048],
                 decode_requests=[1, 8, 32, 64, 128, 256], contexts=[128, 512, 2048],
                 max_prefill_tokens=16384),
}
OVERHEAD_BATCHES = (1, 8, 32, 1, 8, 32)  # twice each: runs differ by a millisecond
OVERHEAD_PROMPT, OVERHEAD_MAX_TOKENS, OVERHEAD_WINDOW = 16, 320, 200


def grid_shapes(grid: dict) -> list[tuple[int, int, int, int]]:
    """(prefill requests, prompt length, decode requests, context) of every grid step."""
    prefills = [(0, 0)] + [(n, p) for n, p in itertools.product(grid["prefill_requests"],
                                                                 grid["prompt_lens"])
                           if n * p <= grid["max_prefill_tokens"]]
    decodes = [(0, 0)] + list(itertools.product(grid["decode_requests"], grid["contexts"]))
    return [(n, p, d, c) for (n, p), (d, c) in itertools.product(prefills, decodes)
            if n + d > 0]


def synthetic_step(shape: tuple[int, int, int, int], block_size: int, setup: bool) -> StepInput:
    """Rows 0.. are the prefills, then the decodes; blocks are numbered from 0. Prefill rows
    carry their admission and block-table deltas, as a request's first step does; decode rows
    rely on the worker's tables, as running requests do, so a `setup` copy (which admits
    every row) must run first."""
    num_prefill, prompt_len, num_decode, context = shape
    step = StepInput()
    next_block = 0
    for row in range(num_prefill + num_decode):
        ctx, n = (0, prompt_len) if row < num_prefill else (context, 1)
        num_blocks = cdiv(ctx + n, block_size)
        if setup or row < num_prefill:
            step.new_requests.append(NewRequest(row, 0.0, 1.0, 0, None))
            step.table_rows += [row] * num_blocks
            step.table_cols += range(num_blocks)
            step.table_blocks += range(next_block, next_block + num_blocks)
        next_block += num_blocks
        step.rows.append(row)
        step.context_lens.append(ctx)
        step.query_lens.append(n)
        step.sample.append(True)
        step.token_ids += [7] * n
    return step


def build_runner(model: str, device: str, block_size: int, shapes, num_threads: int):
    from engine_actors.checkpoint import load_hf_config, resolve_model_path
    from engine_actors.model_loader import resolve_dtype
    from engine_actors.model_runner import ModelRunner
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if device == "cpu":
        torch.set_num_threads(num_threads)  # as a worker with num_cpus_per_worker threads
    path = resolve_model_path(model)
    max_len = load_hf_config(path).max_position_embeddings
    longest = max(max(p, c + 1) for _, p, _, c in shapes)
    if longest > max_len:
        raise ValueError(f"the grid needs {longest}-token sequences; {model} allows {max_len}")
    max_rows = max(n + d for n, _, d, _ in shapes)
    max_blocks = max(n * cdiv(p, block_size) + d * cdiv(c + 1, block_size)
                     for n, p, d, c in shapes)
    runner = ModelRunner(path, device, resolve_dtype("auto", device), max_len, block_size,
                         max_rows, seed=0, use_cuda_graphs=device == "cuda")
    runner.allocate_kv_cache(max_blocks)
    runner.capture_cuda_graphs(max(d for _, _, d, _ in shapes))  # a no-op on CPU
    return runner


def measure_grid(runner, shapes, block_size: int, repeats: int) -> list[dict]:
    """`repeats` passes over the grid, each in a new shuffled order, so that a burst of load
    from elsewhere on the machine spoils one sample of many steps rather than all samples of
    a few; each step is measured right after an untimed setup copy of itself."""
    times: dict[tuple, list[float]] = {shape: [] for shape in shapes}
    rng = np.random.default_rng(0)
    for _ in range(repeats):
        for i in rng.permutation(len(shapes)):
            shape = shapes[i]
            runner.execute(synthetic_step(shape, block_size, setup=True))
            step = synthetic_step(shape, block_size, setup=False)
            t0 = time.perf_counter()
            runner.execute(step)  # returns once the sampled ids are on the host
            times[shape].append(time.perf_counter() - t0)
    return [{"shape": list(shape),
             "features": dataclasses.asdict(step_features(synthetic_step(shape, block_size,
                                                                         setup=False))),
             "median_s": float(np.median(ts)), "min_s": min(ts)} for shape, ts in times.items()]


def measure_actor_overhead(model: str, device: str, block_size: int, compute) -> dict:
    """Per-iteration wall time of the scheduler actor loop minus fitted compute, at several
    batch sizes; fitted as o0 + o_req * B."""
    import ray

    from load_tests.engine_replay import LocalEngine, run_batch
    b_max = max(OVERHEAD_BATCHES)
    args = dict(model=model, device=device, block_size=block_size, async_scheduling=False,
                max_batch_size=b_max, max_num_batched_tokens=max(512, b_max * OVERHEAD_PROMPT),
                max_num_tokens=b_max * (OVERHEAD_PROMPT + OVERHEAD_MAX_TOKENS + block_size))
    rows = []
    with LocalEngine(args) as actor:
        asyncio.run(run_batch(actor, OVERHEAD_PROMPT, 32, b_max))  # warm-up
        for b in OVERHEAD_BATCHES:
            asyncio.run(run_batch(actor, OVERHEAD_PROMPT, OVERHEAD_MAX_TOKENS, b))
            trace = ray.get(actor.executor_call.remote("step_traces"))[0][-OVERHEAD_WINDOW:]
            # the run's last steps are decodes of all b requests; the last one reads a
            # context of prompt + max_tokens - 2 tokens, each earlier one one fewer
            last_ctx = OVERHEAD_PROMPT + OVERHEAD_MAX_TOKENS - 2
            ctxs = [last_ctx - (len(trace) - 1 - k) for k in range(len(trace))]
            walls = [trace[k][4] - trace[k - 1][4] for k in range(1, len(trace))]
            predicted = [compute.step_time(StepFeatures(decode_requests=b, context_tokens=b * c))
                         for c in ctxs[1:]]
            in_worker = [s[4] - s[2] for s in trace[1:]]
            gaps = [trace[k][2] - trace[k - 1][4] for k in range(1, len(trace))]
            rows.append({"batch": b, "num_steps": len(walls),
                         "wall_per_step_s": float(np.mean(walls)),
                         "predicted_compute_s": float(np.mean(predicted)),
                         "in_worker_s": float(np.mean(in_worker)),
                         "control_plane_gap_s": float(np.mean(gaps)),
                         "extra_s": float(np.mean(walls) - np.mean(predicted))})
    x = np.array([[1.0, r["batch"]] for r in rows])
    (o0, o_req), *_ = np.linalg.lstsq(x, np.array([r["extra_s"] for r in rows]), rcond=None)
    return {"engine_args": args, "prompt_len": OVERHEAD_PROMPT,
            "max_tokens": OVERHEAD_MAX_TOKENS, "runs": rows, "o0_s": float(o0),
            "o_req_s": float(o_req)}


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random-llama")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per grid step")
    p.add_argument("--num-threads", type=int, default=1,
                   help="CPU: torch threads, as a worker with num_cpus_per_worker=1")
    p.add_argument("--no-actor", action="store_true",
                   help="compute only: skip the scheduler-actor overhead (c0 then lacks it)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    command = "python -m load_tests.cost_model " + shlex.join(
        sys.argv[1:] if argv is None else argv)

    shapes = grid_shapes(GRIDS[args.device])
    runner = build_runner(args.model, args.device, args.block_size, shapes, args.num_threads)
    points = measure_grid(runner, shapes, args.block_size, args.repeats)
    del runner  # the engine's worker below needs the device memory
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    features = [StepFeatures(**pt["features"]) for pt in points]
    chosen, candidates = select(features, [pt["median_s"] for pt in points])
    compute = model_of(chosen)
    overhead = None
    model = compute
    if not args.no_actor:
        overhead = measure_actor_overhead(args.model, args.device, args.block_size, compute)
        per_req = overhead["o_req_s"]
        model = dataclasses.replace(
            compute, c0=compute.c0 + overhead["o0_s"], c_decode=compute.c_decode + per_req,
            c_prefill_req=compute.c_prefill_req + per_req if compute.c_prefill_req else 0.0)
    report = {
        "model": model.as_dict(), "compute_model": compute.as_dict(),
        "fit": {**dataclasses.asdict(chosen),
                "method": "least squares of relative errors (rows weighted by 1/time)",
                "rule": "forward selection: an optional term enters when it cuts the "
                        "relative RMS error by >= 10%"},
        "candidates": [dataclasses.asdict(c) for c in candidates],
        "actor_overhead": overhead,
        "engine": {"model": args.model, "device": args.device, "block_size": args.block_size,
                   "num_threads": args.num_threads if args.device == "cpu" else None,
                   "sampling": "greedy", "async_scheduling": False},
        "grid": {"spec": GRIDS[args.device], "repeats": args.repeats, "points": points},
        "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"fit {chosen.terms}: R^2 {chosen.r2:.4f}, relative error median "
          f"{chosen.rel_median:.3f} p90 {chosen.rel_p90:.3f} over {len(points)} steps")
    print("model (s):", json.dumps(model.as_dict()))
    return report
