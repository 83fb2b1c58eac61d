"""INT4 projections (W4A16) against bf16 ones: llama-8b's four matmuls of one layer.

    python -m load_tests.bench_int4 --tokens 1 16 64 256 2048 [--sweep]

Per token count M, the summed time of the qkv, o, gate_up and down projections:
bf16 F.linear (cuBLAS), kernels.int4.int4_matmul (groups of 128) with its default tile,
and with --sweep each config of SWEEP; the floor is the INT4 weights' bytes (words and
scales) at the measured copy bandwidth. Each is timed over a CUDA graph of 20 calls.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels.int4 import CONFIGS, int4_matmul
from load_tests.bench_fp8 import SHAPES, graph_ms
from load_tests.gpu_ceilings import copy_bandwidth_gbs
from load_tests.report import save_json

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
SWEEP = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4),
         (16, 32, 64, 2, 4), (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3),
         (64, 64, 32, 4, 4), (128, 128, 32, 8, 3), (128, 64, 64, 4, 3)]


def packed(n: int, k: int, group: int):
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    scales = torch.rand(n, k // group, device="cuda") / 100
    return words, scales


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    bandwidth = copy_bandwidth_gbs()
    weights = {name: (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                      *packed(n, k, args.group)) for name, (n, k) in SHAPES.items()}
    floor = sum(w.numel() * 4 + s.numel() * 4 for _, w, s in weights.values()) / bandwidth / 1e6
    rows = []
    for m in args.tokens:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for name, (n, k) in SHAPES.items()}

        def run(fn):
            return lambda: [fn(xs[name], *weights[name]) for name in SHAPES]
        row = {"tokens": m, "int4_floor_ms": floor,
               "bf16_ms": graph_ms(run(lambda x, w, q, s: F.linear(x, w))),
               "int4_ms": graph_ms(run(lambda x, w, q, s: int4_matmul(x, q, s, args.group)))}
        for config in SWEEP * args.sweep:
            row.setdefault("sweep_ms", {})[str(config)] = graph_ms(run(
                lambda x, w, q, s: int4_matmul(x, q, s, args.group, config=config)))
        best = min(row.get("sweep_ms", {"-": row["int4_ms"]}).items(), key=lambda kv: kv[1])
        default = next(c for limit, c in CONFIGS if limit is None or m <= limit)
        print(f"M={m:5d}: bf16 {row['bf16_ms']:.3f} ms | int4 {row['int4_ms']:.3f} ms "
              f"(default {default}) | best {best[1]:.3f} {best[0]} | int4 floor {floor:.3f}",
              flush=True)
        rows.append(row)
    report = {"shapes": SHAPES, "group": args.group, "copy_gbs": bandwidth, "rows": rows}
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
