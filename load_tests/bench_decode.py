"""Decode step time at a given batch size against its memory floor.

    python -m load_tests.bench_decode --model llama-8b --batch-size 64 --context-len 512

A decode step must read every weight once and every cached key/value of the batch once,
so (weight bytes + KV bytes) / measured copy bandwidth is its floor. Steps are launched
back to back through ModelRunner.launch, as the worker does (CUDA graph when captured),
and timed with CUDA events over many steps.
"""
from __future__ import annotations

import argparse
import json

import torch

from engine_actors.checkpoint import resolve_model_path
from engine_actors.kv_cache import cdiv
from engine_actors.messages import NewRequest, StepInput
from engine_actors.model_runner import ModelRunner
from load_tests.gpu_ceilings import copy_bandwidth_gbs


def weight_bytes(model) -> int:
    """Bytes a decode step reads: all weights, except the input embedding table when it is not
    also the LM head (a step reads only its batch's rows of it)."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if tied or not name.startswith("embed_tokens"))


def time_decode(runner: ModelRunner, batch: int, context_len: int, iters: int) -> float:
    """Mean ms per step over `iters` back-to-back steps, after warm-up."""
    blocks_each = cdiv(context_len + iters + 8, runner.block_size)
    first = StepInput(new_requests=[NewRequest(r, 0.0, 1.0, 0, None) for r in range(batch)],
                      rows=list(range(batch)), context_lens=[context_len] * batch,
                      query_lens=[1] * batch, sample=[True] * batch, token_ids=[1] * batch,
                      table_rows=[r for r in range(batch) for _ in range(blocks_each)],
                      table_cols=list(range(blocks_each)) * batch,
                      table_blocks=list(range(batch * blocks_each)))
    runner.launch(first).wait()

    def step(i):
        return StepInput(rows=list(range(batch)), context_lens=[context_len + i] * batch,
                         query_lens=[1] * batch, sample=[True] * batch, token_ids=[-1] * batch)

    for i in range(5):
        runner.launch(step(i)).wait()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    pending = [runner.launch(step(i)) for i in range(iters)]
    stop.record()
    pending[-1].wait()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth_gbs()
    batch, ctx = args.batch_size, args.context_len
    runner = ModelRunner(resolve_model_path(args.model), "cuda", torch.bfloat16, 8192, 16, batch, 0)
    num_blocks = batch * cdiv(ctx + args.iters + 8, 16)
    runner.allocate_kv_cache(num_blocks)
    for k, v in runner.kv_caches:  # never time on zeros
        k.normal_()
        v.normal_()
    eager_ms = time_decode(runner, batch, ctx, args.iters)
    runner.capture_cuda_graphs(batch)
    graph_ms = time_decode(runner, batch, ctx, args.iters)
    kv_bytes = batch * (ctx + args.iters // 2) * runner.kv_bytes_per_block() // runner.block_size
    floor_ms = (weight_bytes(runner.model) + kv_bytes) / (bandwidth * 1e9) * 1e3
    report = {"model": args.model, "batch_size": batch, "context_len": ctx,
              "copy_gbs": bandwidth, "weight_gb": weight_bytes(runner.model) / 1e9,
              "kv_gb": kv_bytes / 1e9, "floor_ms": floor_ms, "eager_ms": eager_ms,
              "graph_ms": graph_ms, "graph_over_floor": graph_ms / floor_ms}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
