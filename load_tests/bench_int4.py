"""INT4 projections (W4A16) against bf16 ones: llama-8b's four matmuls of one layer.

    python -m load_tests.bench_int4 --tokens 1 16 64 128 256 2048 [--sweep] [--act-order]
        [--zero-points] [--bits 8]

Per token count M, the summed time of the qkv, o, gate_up and down projections (groups of
128): bf16 F.linear (cuBLAS); kernels.int4's kernel (int4_matmul, its default tile and
split of K) and its other path, the weight unpacked to bf16 then cuBLAS, each at every M;
and what int4_linear picks. With --sweep, each (tile, split) of TILES at up to 128 tokens.
With --act-order, also the kernel and int4_linear on act-order weights (each part of qkv
and gate_up in its own random column order: x gathered into it). With --zero-points, also
int4_linear on weights with zero points (random ones). Scales are stored group by group
(kernels.int4_layout.by_group, as the engine stores them); kernel_row_scales is the kernel with
them stored row by row, the layout before.
With --bits 8 every path but bf16's takes INT8 weights (W8A16) instead.
The floor is the INT4 weights' bytes (words and scales) at the measured copy bandwidth.
Each is timed over a CUDA graph of 20 calls; each kernel's output is checked against the
dequantized weight's matmul first.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels.int4 import CONFIGS, dequantize, dequantize_tiled, int4_linear, int4_matmul
from kernels.int4_layout import ColumnOrder, by_group, tile, tile_parts
from load_tests.bench_fp8 import SHAPES, graph_ms
from load_tests.gpu_ceilings import copy_bandwidth_gbs
from load_tests.report import save_json

# (BLOCK_M, BLOCK_K, num_warps, num_stages)
TILES = [(16, 128, 4, 3), (16, 128, 4, 4), (16, 128, 8, 3), (64, 128, 4, 3), (64, 128, 8, 3),
         (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3)]


def sweep(m: int):
    """(tile, split_k) to try at m tokens."""
    return [(t, split) for t in TILES if t[0] <= max(16, m) * 2 for split in (1, 2, 4, 8)]


NAMES = {(k, -(-n // 128)): name for name, (n, k) in SHAPES.items()}  # (K, tiles) -> name
PARTS = {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}  # rows of stacked projections


def random_order(name: str, n: int, k: int) -> ColumnOrder:
    """Each part of projection `name` in a random column order (kernels.int4_layout.ColumnOrder)."""
    ends = torch.tensor(PARTS.get(name, (n,))).cumsum(0).tolist()
    rows = tuple((end - size, end) for end, size in zip(ends, PARTS.get(name, (n,))))
    columns = torch.stack([torch.randperm(k, device="cuda") for _ in rows])
    return tile_parts(ColumnOrder(columns, rows), n)


def in_input_order(stored: torch.Tensor, order: ColumnOrder | None) -> torch.Tensor:
    """A dequantized weight whose parts' columns are in an act-order's stored order, with
    each column put back at its input column (what the weight means)."""
    if order is None:
        return stored
    weight = torch.empty_like(stored)
    for (start, end), columns in zip(order.rows, order.columns):
        weight[start:end, columns] = stored[start:end]
    return weight


def packed(n: int, k: int, group: int, bits: int):
    words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), dtype=torch.int32,
                          device="cuda")
    scales = torch.rand(n, k // group, device="cuda") / 100
    return words, scales


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 2048])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--zero-points", action="store_true")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    bandwidth = copy_bandwidth_gbs()
    g, b = args.group, args.bits
    weights, row_scales = {}, {}  # (scales stored row by row, as before by_group)
    for name, (n, k) in SHAPES.items():
        words, scales = packed(n, k, g, b)
        weights[name] = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                         words, tile(words), by_group(scales), random_order(name, n, k))
        row_scales[name] = scales
    floor = sum(w.numel() * 4 + s.numel() * 4 for _, w, _, s, _ in weights.values()) \
        / bandwidth / 1e6
    paths = {"bf16_ms": lambda x, w, q, s, o: F.linear(x, w),
             "kernel_ms": lambda x, w, q, s, o: int4_matmul(x, q, s, g, bits=b),
             "dequantized_cublas_ms": lambda x, w, q, s, o: F.linear(
                 x, dequantize_tiled(q, s, g, x.shape[1], x.dtype, bits=b)),
             "int4_linear_ms": lambda x, w, q, s, o: int4_linear(x, q, s, g, x.shape[1],
                                                                 bits=b),
             "kernel_row_scales_ms": lambda x, w, q, s, o: int4_matmul(
                 x, q, row_scales[NAMES[x.shape[1], q.shape[0]]], g, bits=b)}
    if args.act_order:
        paths["act_order_kernel_ms"] = lambda x, w, q, s, o: int4_matmul(x, q, s, g, order=o,
                                                                         bits=b)
        paths["act_order_int4_linear_ms"] = lambda x, w, q, s, o: int4_linear(
            x, q, s, g, x.shape[1], order=o, bits=b)
    zeros = {name: by_group(torch.randint(0, 1 << b, (n, k // g), device="cuda").float())
             for name, (n, k) in SHAPES.items()}
    if args.zero_points:
        paths["zero_points_int4_linear_ms"] = lambda x, w, q, s, o: int4_linear(
            x, q, s, g, x.shape[1], zeros=zeros[NAMES[x.shape[1], q.shape[0]]], bits=b)
    rows = []
    for m in args.tokens:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for name, (n, k) in SHAPES.items()}
        wants = {(name, kind): F.linear(xs[name].float(), in_input_order(dequantize(
                     plain, s, g, k, torch.float32,
                     zeros=zeros[name] if kind == "zero_points" else None, bits=b),
                     order if kind == "act_order" else None))
                 for name, (_, k) in SHAPES.items() for _, plain, _, s, order in [weights[name]]
                 for kind in ("plain", "act_order", "zero_points")}

        def check(label, fn):
            for name in SHAPES:
                kind = next((k for k in ("act_order", "zero_points") if label.startswith(k)),
                            "plain")
                got, want = fn(name).float(), wants[name, kind]
                error = ((got - want).norm() / want.norm()).item()
                if error > 1e-2:
                    raise AssertionError(f"{label} {name} M={m}: relative error {error:.3g}")

        def operands(name):  # x, the bf16 weight, the tiled INT4 weight, its scales, an order
            w, _, q, s, order = weights[name]
            return xs[name], w, q, s, order

        row = {"tokens": m, "int4_floor_ms": floor}
        for label, fn in paths.items():
            if label != "bf16_ms":
                check(label, lambda name: fn(*operands(name)))
            row[label] = graph_ms(lambda: [fn(*operands(name)) for name in SHAPES])
        for t, split in sweep(m) if args.sweep and m <= 128 else []:
            key = str((t, split))
            check(key, lambda name: int4_matmul(*operands(name)[:3:2], operands(name)[3], g,
                                                config=t, split_k=split, bits=b))
            for name in SHAPES:
                x, _, q, s, _ = operands(name)
                row.setdefault("sweep_ms", {}).setdefault(key, {})[name] = graph_ms(
                    lambda: int4_matmul(x, q, s, g, config=t, split_k=split, bits=b))
        default = next(c for limit, c in CONFIGS if limit is None or m <= limit)
        print(f"M={m:5d}: bf16 {row['bf16_ms']:.3f} | kernel {row['kernel_ms']:.3f} "
              f"(tile {default}) | dequantized + cuBLAS {row['dequantized_cublas_ms']:.3f} | "
              f"int4_linear {row['int4_linear_ms']:.3f} | floor {floor:.3f} ms", flush=True)
        extra = [f"{label[:-3]} {row[label]:.3f}" for label in paths
                 if label.startswith(("act_order", "zero_points", "kernel_row"))]
        if extra:
            print("    " + " | ".join(extra) + " ms", flush=True)
        by_total = sorted(row.get("sweep_ms", {}).items(), key=lambda kv: sum(kv[1].values()))
        for key, t in by_total[:4]:
            print(f"    {sum(t.values()):.3f} {key}", flush=True)
        rows.append(row)
    report = {"shapes": SHAPES, "group": g, "bits": b, "copy_gbs": bandwidth, "rows": rows}
    save_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
