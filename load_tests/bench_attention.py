"""The paged attention kernel alone, 16-bit against FP8 KV pools (kv_cache_dtype), llama-8b's
heads (32 query, 8 KV, 128 dims), one step's 32 layers as one CUDA graph.

    python -m load_tests.bench_attention --out attention.json
    python -m load_tests.bench_attention --splits-sweep --out splits.json

For each case and pool it times what the engine launches (`engine`: kernels.attention's
choices) and the alternatives those choices were made from: keys per loop iteration
(block_n), pipeline stages, and the products' input type (bf16 or fp16).

--splits-sweep times decode steps of few requests with each request's keys split into 1 to
32 chunks (flash decoding; `engine`: kernels.split_kv.decode_splits's choice). There each
layer reads keys and values of its own, so that nothing stays in L2.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from kernels import attention as A
from load_tests.report import save_json

CASES = {"decode-b64-ctx4096": (64, 4096, 1), "decode-b64-ctx512": (64, 512, 1),
         "prefill-2x2048": (2, 2048, 2048)}  # (requests, context, new tokens each)
POOLS = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def paged_batch(requests: int, context: int, new: int, pool: torch.dtype, block: int = 16):
    blocks = requests * (context // block + 1)
    k = torch.randn(blocks * block, 8, 128, device="cuda").to(pool)
    v = torch.randn(blocks * block, 8, 128, device="cuda").to(pool)
    tables = torch.randperm(blocks, device="cuda").view(requests, -1).int()
    q = torch.randn(requests * new, 32, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(requests + 1, device="cuda", dtype=torch.int32) * new
    lens = torch.full((requests,), context, device="cuda", dtype=torch.int32)
    return q, k, v, cu, lens, tables


def launch(batch, new: int, block_n: int, stages: int, dot) -> torch.Tensor:
    """The kernel as paged_attention_triton launches it, with these three set."""
    q, k, v, cu, lens, tables = batch
    block_m, rows, dim_p2 = A.tile_shape(32, 8, 128, new)
    out = torch.empty_like(q)
    grid = (lens.shape[0], triton.cdiv(new, block_m), 8)
    A._paged_attention_kernel[grid](
        q, k, v, out, cu, lens, tables, cu, out, 128 ** -0.5 * 1.4426950408889634, 0.0, 1.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        tables.stride(0), BLOCK_SIZE=16, GROUP=4, HEAD_DIM=128, DIM_P2=dim_p2, BLOCK_M=block_m,
        ROWS=rows, BLOCK_N=block_n, PRECISION="tf32", WORK=False, WINDOW=0, SOFTCAP=False,
        DOT=dot, SPLITS=1, num_stages=stages)
    return out


def step_ms(fn, layers: int = 32) -> float:
    """One step's layers (fn called `layers` times) captured as one graph: median ms of its
    replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=200, return_mode="median")


SWEEP = [(1, 512), (1, 4096), (1, 32768), (2, 8192), (4, 2048), (4, 32768), (8, 8192),
         (16, 2048), (16, 16384), (32, 1024), (32, 8192), (64, 4096)]  # (requests, context)


def splits_sweep(pool: torch.dtype) -> dict:
    cases = {}
    for requests, context in SWEEP:
        layers = [paged_batch(requests, context, 1, pool) for _ in range(32)]
        engine = A.decode_splits(requests, 8, torch.device("cuda"))

        def step(splits):
            for q, k, v, cu, lens, tables in layers:
                A.paged_attention_triton(q, k, v, cu, lens, tables, 16, 128 ** -0.5, 1,
                                         splits=splits)
        row = {"engine_splits": engine}
        for splits in (1, 2, 4, 8, 16, 32):
            row[f"s{splits}"] = step_ms(lambda: step(splits), layers=1)  # step: all 32
        row["engine"] = row[f"s{engine}"]
        kv_bytes = 32 * 2 * requests * context * 8 * 128 * pool.itemsize
        row["engine_tbs"] = kv_bytes / row["engine"] / 1e9
        cases[f"b{requests}-ctx{context}"] = row
        layers.clear()  # (their memory back before the next case)
        torch.cuda.empty_cache()
        best = min((ms, key) for key, ms in row.items() if key.startswith("s"))
        print(f"b{requests} ctx{context}: s1 {row['s1']:.3f} ms, engine s{engine} "
              f"{row['engine']:.3f} ms ({row['engine_tbs']:.2f} TB/s), best {best[1]} "
              f"{best[0]:.3f} ms", flush=True)
    return cases


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--splits-sweep", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = {"device": torch.cuda.get_device_name(), "cases": {}}
    if args.splits_sweep:
        for pool_name, pool in POOLS.items():
            print(f"== {pool_name}", flush=True)
            report["cases"][pool_name] = splits_sweep(pool)
        save_json(args.out, report)
        return report
    for case, (requests, context, new) in CASES.items():
        for pool_name, pool in POOLS.items():
            batch = paged_batch(requests, context, new, pool)
            q, k, v, cu, lens, tables = batch
            row = {"engine": step_ms(lambda: A.paged_attention_triton(
                q, k, v, cu, lens, tables, 16, 128 ** -0.5, new))}
            dots = {"bf16": tl.bfloat16, "fp16": tl.float16} if pool != torch.bfloat16 \
                else {"bf16": tl.bfloat16}
            for dot_name, dot in dots.items():
                for block_n in (64, 128, 256) if new == 1 else (64, 128):
                    for stages in (2, 3):
                        key = f"{dot_name}-n{block_n}-s{stages}"
                        row[key] = step_ms(lambda: launch(batch, new, block_n, stages, dot))
            report["cases"][f"{case}-{pool_name}"] = row
            best = min((ms, key) for key, ms in row.items())
            print(f"{case} {pool_name}: engine {row['engine']:.3f} ms, best {best[1]} "
                  f"{best[0]:.3f} ms", flush=True)
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
