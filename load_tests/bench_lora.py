"""LoRA serving cost: a decode step whose batch is spread over N adapters against the base
model's step, on the same weights, in one process.

    python -m load_tests.bench_lora --model llama-8b --batch-size 64 --adapters 1 2 8 32

Adapters are random, rank --rank, on all of q/k/v/o/gate/up/down (PEFT's format, written to a
temp dir). Rows: the base model without LoRA; the same runner with LoRA slots and only
base-model requests (the cost of having LoRA on); then request i on adapter i mod N. Steps
run as the worker runs them (CUDA graphs), timed with CUDA events. The offline trace over
adapters is `bench_offline --adapters 0 8`.

    python -m load_tests.bench_lora --kernels   # the LoRA kernels alone, per projection

--kernels times one LoRA launch (shrink + expand) on llama-8b's projections for a decode batch
and for prefill batches over 8 adapters, against the projection's own matmul and against
the launch's memory floor (x read, y read and written, the adapters' weights), for a few
tile shapes.
"""
from __future__ import annotations

import gc
import json
import os
import tempfile

import torch

from engine_actors.checkpoint import load_hf_config, resolve_model_path
from engine_actors.kv_cache import cdiv
from engine_actors.layers import lora as lora_layers
from engine_actors.lora_files import TARGETS
from engine_actors.model_runner import ModelRunner
from load_tests.bench_decode import decode_arguments, time_decode
from load_tests.report import save_json


def save_random_adapters(model_path: str, out_dir: str, count: int, rank: int,
                         targets=TARGETS, seed: int = 0) -> dict[str, str]:
    """`count` random PEFT LoRA adapters of `model_path` in out_dir; name -> path."""
    from safetensors.torch import save_file
    cfg = load_hf_config(model_path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    shapes = {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv),
              "v_proj": ("self_attn", h, kv), "o_proj": ("self_attn", q, h),
              "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i), "down_proj": ("mlp", i, h)}
    gen = torch.Generator().manual_seed(seed)
    paths = {}
    for n in range(count):
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for target in targets:
                block, d_in, d_out = shapes[target]
                key = f"base_model.model.model.layers.{layer}.{block}.{target}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, d_in, generator=gen) / d_in ** 0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(d_out, rank, generator=gen) / rank ** 0.5).bfloat16()
        paths[f"lora{n}"] = path = os.path.join(out_dir, f"lora{n}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": list(targets), "bias": "none"}, f)
    return paths


# llama-8b's LoRA projections: (K in, N out, stacked rank at rank 16)
PROJECTIONS = {"qkv": (4096, 6144, 48), "o": (4096, 4096, 16), "gate_up": (4096, 28672, 32),
               "down": (14336, 4096, 16)}


def bench_kernels(num_adapters: int = 8) -> list[dict]:
    import numpy as np
    from triton.testing import do_bench, do_bench_cudagraph

    from kernels.lora import group_tokens, lora_triton
    bandwidth = 4.2e12  # bytes/s, H200 copy bandwidth (gpu_ceilings), for the floor only
    rows = []
    for name, (k, n, r) in PROJECTIONS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        a = torch.randn(num_adapters, r, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(num_adapters, n, r, device="cuda", dtype=torch.bfloat16) / r ** 0.5
        for tokens, req_len in [(64, 1), (2048, 256), (16384, 256)]:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
            slots = np.repeat(np.arange(tokens // req_len) % num_adapters, req_len)
            bench = do_bench_cudagraph if tokens <= 64 else do_bench
            base_ms = bench(lambda: torch.matmul(x, w.T, out=y))
            floor_ms = (x.numel() * 2 + y.numel() * 4 + (a.numel() + b.numel()) * 2) \
                / bandwidth * 1e3
            for tile, block_n in [(16, 256), (32, 128), (64, 128), (64, 256)]:
                order, tiles = group_tokens(slots.astype(np.int32), tile)
                order = torch.tensor(order, device="cuda")
                tiles = torch.tensor(tiles, dtype=torch.int32, device="cuda")
                ms = bench(lambda: lora_triton(y, x, a, b, order, tiles, tile, block_n))
                rows.append({"projection": name, "tokens": tokens, "tile": tile,
                             "block_n": block_n, "lora_us": ms * 1e3, "matmul_us": base_ms * 1e3,
                             "floor_us": floor_ms * 1e3})
                print(f"{name:<8}{tokens:>6} tile {tile:>2} n {block_n:>3}: lora "
                      f"{ms * 1e3:8.1f} us  matmul {base_ms * 1e3:8.1f} us  floor "
                      f"{floor_ms * 1e3:7.1f} us", flush=True)
    return rows


def new_runner(model_path: str, batch: int, ctx: int, iters: int, lora=None) -> ModelRunner:
    runner = ModelRunner(model_path, "cuda", torch.bfloat16, 8192, 16, batch, 0, lora=lora)
    runner.allocate_kv_cache(batch * cdiv(ctx + 4 * iters + 64, runner.block_size))
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    runner.capture_cuda_graphs(batch)
    return runner


def main(argv=None) -> dict:
    p = decode_arguments(__doc__)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 2, 8, 32])
    p.add_argument("--kernels", action="store_true", help="time the kernels alone")
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = ({"device": torch.cuda.get_device_name(), "kernels": bench_kernels()}
              if args.kernels else bench_decode_steps(args))
    save_json(args.out, report)
    return report


def bench_decode_steps(args) -> dict:
    path = resolve_model_path(args.model)
    batch, ctx, iters = args.batch_size, args.context_len, args.iters
    runner = new_runner(path, batch, ctx, iters)
    rows = {"base (LoRA off)": time_decode(runner, batch, ctx, iters)}
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    slots = max(args.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = save_random_adapters(path, tmp, slots, args.rank)
        runner = new_runner(path, batch, ctx, iters, lora=(slots, args.rank))
        for slot, adapter in enumerate(adapters.values()):
            with open(os.path.join(adapter, "adapter_model.safetensors"), "rb") as f:
                lora_layers.load_adapter(runner.model, slot, f.read(), 2.0)
    rows["base (LoRA on)"] = time_decode(runner, batch, ctx, iters)
    for n in args.adapters:
        rows[f"{n} adapters"] = time_decode(runner, batch, ctx, iters,
                                            lora_slots=[r % n for r in range(batch)])
    base = rows["base (LoRA off)"]
    report = {"model": args.model, "batch_size": batch, "context_len": ctx, "rank": args.rank,
              "targets": list(TARGETS), "device": torch.cuda.get_device_name(),
              "step_ms": rows, "over_base": {k: v / base for k, v in rows.items()}}
    print(json.dumps(report, indent=2))
    print(f"{'batch ' + str(batch):<18}{'step ms':>9}{'x base':>8}")
    for name, ms in rows.items():
        print(f"{name:<18}{ms:>9.2f}{ms / base:>8.2f}")
    return report


if __name__ == "__main__":
    main()
