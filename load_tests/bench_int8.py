"""W8A8 INT8 projections against bf16 and W8A16 ones: llama-8b's four matmuls of one layer.

    python -m load_tests.bench_int8 --tokens 1 16 64 128 256 2048 [--sweep]

Per token count M, the summed time of the qkv, o, gate_up and down projections, each timed
over a CUDA graph of 20 calls:
- bf16: F.linear (cuBLAS);
- w8a16: kernels.int4's INT8 weights (one scale per row), x in bf16 (what a W8A16
  checkpoint, or a W8A8 one with zero points, runs);
- w8a8: kernels.int8.int8_linear, what the engine runs for a W8A8 checkpoint (up to 32
  tokens the weight-only kernel, beyond x quantized per token then the int8 kernel);
- w8a8_quantized: x quantized per token then the int8 kernel, at every M; quantize: the
  quantization alone; weight_only: kernels.fp8's weight-only kernel on the int8 weight.
Each path's output is checked against its definition first. With --sweep, the int8
kernel's fastest tiles at each M (kernels.int8.CONFIGS' candidates).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from kernels import int8
from kernels.fp8 import weight_only_matmul
from kernels.int4 import int4_linear
from kernels.int4_layout import by_group, pack, tile
from load_tests.bench_fp8 import SHAPES, graph_ms
from load_tests.report import save_json


def weights() -> dict:
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        scales = w.float().abs().amax(1) / 127
        q = (w.float() / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        packed = tile(pack(q.int() + 128, 8))
        out[name] = dict(bf16=w, q=q, scales=scales, packed=packed,
                         packed_scales=by_group(scales[:, None].clone()), k=k)
    return out


def paths(ws: dict, xs: dict) -> dict:
    """name -> a callable running one layer's four projections that way."""
    return {
        "bf16": lambda: [F.linear(xs[n], ws[n]["bf16"]) for n in ws],
        "w8a16": lambda: [int4_linear(xs[n], ws[n]["packed"], ws[n]["packed_scales"],
                                      ws[n]["k"], ws[n]["k"], bits=8) for n in ws],
        "w8a8": lambda: [int8.int8_linear(xs[n], ws[n]["q"], ws[n]["scales"]) for n in ws],
        "w8a8_quantized": lambda: [int8.int8_matmul(*int8.quantize_rows(xs[n]), ws[n]["q"],
                                                    ws[n]["scales"], torch.bfloat16)
                                   for n in ws],
        "quantize": lambda: [int8.quantize_rows(xs[n]) for n in ws],
        "weight_only": lambda: [weight_only_matmul(xs[n], ws[n]["q"], ws[n]["scales"], None)
                                for n in ws],
    }


def check(ws: dict, xs: dict) -> dict:
    """Each path's relative error against its definition in fp32 (x quantized per token
    or not, times the dequantized weight)."""
    errors = {}
    for name, fn in paths(ws, xs).items():
        if name in ("bf16", "quantize"):
            continue
        for (n, w), y in zip(ws.items(), fn()):
            x = xs[n].float()
            quantized = name == "w8a8_quantized" or (
                name == "w8a8" and x.shape[0] > int8.WEIGHT_ONLY_MAX_TOKENS)
            if quantized:
                s = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
                x = torch.round(x / s).clamp(-128, 127) * s
            want = x @ (w["q"].float() * w["scales"][:, None]).T
            errors[name] = max(errors.get(name, 0.0),
                               ((y.float() - want).norm() / want.norm()).item())
    return errors


def sweep(ws: dict, xs: dict, m: int) -> list:
    """The int8 kernel's three fastest tiles at m tokens, summed over the layer."""
    found = []
    quantized = {n: int8.quantize_rows(xs[n]) for n in ws}
    for bm, bn, bk, warps, stages in itertools.product(
            (16, 32, 64, 128), (64, 128, 256), (64, 128, 256), (4, 8), (3, 4)):
        if bm > max(16, 2 * m) or bm * bn * bk > 128 * 256 * 128:
            continue
        cfg = (bm, bn, bk, warps, stages)
        try:
            ms = graph_ms(lambda: [int8.int8_matmul(*quantized[n], ws[n]["q"], ws[n]["scales"],
                                                    torch.bfloat16, config=cfg) for n in ws],
                          reps=5)
        except Exception as e:  # (a tile over the shared memory)
            print(f"  {cfg}: {type(e).__name__}", flush=True)
            continue
        found.append((round(ms, 4), cfg))
    return sorted(found)[:3]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 2048])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="load_tests/results/int8-layer.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    ws = weights()
    rows = []
    for m in args.tokens:
        xs = {n: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for n, (_, k) in SHAPES.items()}
        row = {"tokens": m, "errors": check(ws, xs),
               **{f"{name}_ms": round(graph_ms(fn), 4) for name, fn in paths(ws, xs).items()}}
        if args.sweep:
            row["best_tiles"] = sweep(ws, xs, m)
        rows.append(row)
        print(row, flush=True)
    print("tokens | bf16 | w8a16 | w8a8 | w8a8_quantized | quantize | weight_only (ms)")
    for r in rows:
        print(f"{r['tokens']} | {r['bf16_ms']} | {r['w8a16_ms']} | {r['w8a8_ms']} | "
              f"{r['w8a8_quantized_ms']} | {r['quantize_ms']} | {r['weight_only_ms']}")
    save_json(args.out, {"rows": rows, "device": torch.cuda.get_device_name()})
    return rows


if __name__ == "__main__":
    main()
