"""Decode steps of few requests over long contexts, each request's keys split into chunks
(flash decoding, kernels.split_kv.decode_splits) against one program per request and KV
head, in one process on one model.

    python -m load_tests.bench_long_decode --model llama-8b --out long-decode.json

For each (batch, context) case: the CUDA-graph step time with the engine's splits and with
splits off (kernels.split_kv.MAX_SPLITS = 1, the graphs captured again), against the
step's memory floor (weights + KV bytes at the measured copy bandwidth, as bench_decode).
"""
from __future__ import annotations

import argparse

import torch

from engine_actors.checkpoint import resolve_model_path
from engine_actors.kv_cache import cdiv
from engine_actors.model_runner import ModelRunner
from kernels import split_kv
from load_tests.bench_decode import graph_size, time_decode, weight_bytes
from load_tests.gpu_ceilings import copy_bandwidth_gbs
from load_tests.report import save_json

CASES = [(1, 512), (1, 4096), (1, 32768), (4, 16384), (16, 4096), (64, 512)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--cases", nargs="*", default=[f"{b}x{c}" for b, c in CASES],
                   help="BATCHxCONTEXT")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    args = p.parse_args(argv)
    cases = [tuple(map(int, c.split("x"))) for c in args.cases]
    bandwidth = copy_bandwidth_gbs()
    runner = ModelRunner(resolve_model_path(args.model), "cuda", torch.bfloat16,
                         max(c for _, c in cases) + args.iters + 16, 16,
                         graph_size(max(b for b, _ in cases)), 0,
                         kv_cache_dtype=args.kv_cache_dtype)
    weights, default = weight_bytes(runner.model), split_kv.MAX_SPLITS
    report = {"model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
              "device": torch.cuda.get_device_name(), "copy_gbs": bandwidth, "cases": {}}
    for batch, context in cases:
        runner.allocate_kv_cache(batch * cdiv(context + args.iters + 8, runner.block_size))
        for k, v in runner.kv_caches:
            k.copy_(torch.randn(k.shape, device=k.device))
            v.copy_(torch.randn(v.shape, device=v.device))
        kv = batch * (context + args.iters // 2) * runner.kv_bytes_per_block() \
            // runner.block_size
        row = {"splits": split_kv.decode_splits(batch, runner.num_kv_heads,
                                                 torch.device("cuda")),
               "floor_ms": (weights + kv) / (bandwidth * 1e9) * 1e3}
        for name, max_splits in (("whole_ms", 1), ("split_ms", default)):
            split_kv.MAX_SPLITS = max_splits
            runner.capture_cuda_graphs(graph_size(batch))
            row[name] = time_decode(runner, batch, context, args.iters)
        split_kv.MAX_SPLITS = default
        row["speedup"] = row["whole_ms"] / row["split_ms"]
        report["cases"][f"b{batch}-ctx{context}"] = row
        print(f"b{batch} ctx{context}: splits {row['splits']}, whole {row['whole_ms']:.3f} ms, "
              f"split {row['split_ms']:.3f} ms ({row['speedup']:.2f}x), floor "
              f"{row['floor_ms']:.3f} ms", flush=True)
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
