"""FP8 projections against bf16 ones: llama-8b's four matmuls at decode and prompt sizes.

    python -m load_tests.bench_fp8 --tokens 1 16 64 256 2048 8192
    python -m load_tests.bench_fp8 --sweep --tokens 16 64 256 2048   # tile configs per size

Per token count M, the summed time of the qkv, o, gate_up and down projections of one layer:
- bf16: F.linear (cuBLAS);
- fp8_rows / fp8_blocks: kernels.fp8.fp8_linear as the engine runs it (the activations'
  quantization included) with one scale per output row, or per 128 x 128 block;
- w8a8_triton_blocks: kernels.fp8's own W8A8 kernel (its fallback for blocks), quantization
  included;
- weight_only_*: its kernel for few tokens (weights widened as they load), at any M, with
  its K range split over programs as the engine does, and unsplit (`_unsplit`);
- scaled_mm_rows_matmul: torch._scaled_mm (cuBLASLt) alone, activations quantized beforehand;
- floor: the weights' bytes (bf16 or e4m3) at the measured copy bandwidth.
Each is timed over a CUDA graph of 20 repetitions. --sweep times each tile config of the
weight-only and W8A8 block kernels and prints the three fastest per M.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from kernels import fp8, fp8_quantize
from kernels.fp8_quantize import FP8, FP8_MAX
from load_tests.gpu_ceilings import copy_bandwidth_gbs
from load_tests.report import save_json

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_ms(fn, reps: int = 20) -> float:
    """Milliseconds per call of fn, replayed from a CUDA graph of `reps` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (10 * reps)


def weights():
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        rows = w.abs().amax(1).float() / FP8_MAX
        blocks = w.float().reshape(n // 128, 128, k // 128, 128).abs().amax((1, 3)) / FP8_MAX
        out[name] = dict(bf16=w, rows=((w.float() / rows[:, None]).to(FP8), rows),
                         blocks=((w.float() / blocks.repeat_interleave(128, 0)
                                  .repeat_interleave(128, 1)).to(FP8), blocks))
    return out


def paths(ws, xs) -> dict:
    """name -> a callable running one layer's four projections that way."""
    def rows_prequantized():  # (the matmul alone: activations quantized beforehand)
        for n in ws:
            torch._scaled_mm(xs[n + "_q"], ws[n]["rows"][0].t(), scale_a=xs[n + "_s"],
                             scale_b=ws[n]["rows"][1][None, :], out_dtype=torch.bfloat16)
    return {
        "bf16": lambda: [F.linear(xs[n], ws[n]["bf16"]) for n in ws],
        "fp8_rows": lambda: [fp8.fp8_linear(xs[n], *ws[n]["rows"], None) for n in ws],
        "fp8_blocks": lambda: [fp8.fp8_linear(xs[n], *ws[n]["blocks"], (128, 128)) for n in ws],
        "w8a8_triton_blocks": lambda: [fp8.fp8_matmul(*fp8_quantize.quantize_groups(xs[n], 128),
                                                      *ws[n]["blocks"], 128, torch.bfloat16)
                                       for n in ws],
        "weight_only_rows": lambda: [fp8.weight_only_matmul(xs[n], *ws[n]["rows"], None)
                                     for n in ws],
        "weight_only_blocks": lambda: [fp8.weight_only_matmul(xs[n], *ws[n]["blocks"],
                                                              (128, 128)) for n in ws],
        "weight_only_rows_unsplit": lambda: [fp8.weight_only_matmul(xs[n], *ws[n]["rows"],
                                                                    None, split_k=1)
                                             for n in ws],
        "scaled_mm_rows_matmul": rows_prequantized,
    }


def inputs(m: int) -> dict:
    xs = {}
    for name, (_, k) in SHAPES.items():
        x = xs[name] = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xs[name + "_q"], xs[name + "_s"] = fp8_quantize.quantize_rows(x)
    return xs


def time_layer(ws, m: int) -> dict:
    return {f"{name}_ms": graph_ms(fn) for name, fn in paths(ws, inputs(m)).items()}


def sweep(ws, m: int) -> dict:
    """The three fastest tile configs of each kernel at m tokens, summed over the layer (the
    weight-only one: row scales, then 128 x 128 blocks; the W8A8 one: blocks)."""
    xs = inputs(m)
    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * m)]
    found = {"weight_only": [], "w8a8_blocks": []}
    saved = fp8.CONFIGS, fp8.SMALL_CONFIGS
    for bm, bn, bk, warps, stages in itertools.product(
            block_ms, (16, 32, 64, 128, 256), (128, 256, 512), (4, 8), (3, 4, 5)):
        if bm * bn > 128 * 256 or (warps == 8 and bm * bn < 64 * 128):
            continue
        for kernel in found:
            if (kernel == "weight_only") != (m < 128) or (kernel == "weight_only" and bn > 64) \
                    or (kernel != "weight_only" and bk != 128) or bn * bk > 32768:
                continue
            fp8.CONFIGS = ((None, (bm, bn, warps, stages)),)
            fp8.SMALL_CONFIGS = ((None, (bm, bn, bk, warps, stages)),)
            try:
                if kernel == "weight_only":
                    ms = graph_ms(lambda: [fp8.weight_only_matmul(xs[n], *ws[n][kind], block)
                                           for n in ws for kind, block in
                                           (("rows", None), ("blocks", (128, 128)))], reps=5)
                else:
                    ms = graph_ms(lambda: [fp8.fp8_matmul(*fp8_quantize.quantize_groups(xs[n], 128),
                                                          *ws[n]["blocks"], 128, torch.bfloat16)
                                           for n in ws], reps=5)
            except Exception as e:  # (a config over the shared memory)
                print(f"  {kernel} {(bm, bn, warps, stages)}: {type(e).__name__}", flush=True)
                continue
            found[kernel].append((round(ms, 4), (bm, bn, bk, warps, stages)))
    fp8.CONFIGS, fp8.SMALL_CONFIGS = saved
    return {k: sorted(v)[:3] for k, v in found.items()}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048, 8192])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    ws = weights()
    gbs = copy_bandwidth_gbs()
    bf16_bytes = sum(2 * n * k for n, k in SHAPES.values())
    rows = []
    for m in args.tokens:
        if args.sweep:
            rows.append({"tokens": m, **sweep(ws, m)})
            print(json.dumps(rows[-1]), flush=True)
            continue
        r = {"tokens": m, **time_layer(ws, m), "floor_bf16_ms": bf16_bytes / gbs / 1e6,
             "floor_fp8_ms": bf16_bytes / 2 / gbs / 1e6}
        rows.append(r)
        print(json.dumps(r), flush=True)
    if not args.sweep:
        names = [k for k in rows[0] if k.endswith("_ms")]
        print("\ntokens | " + " | ".join(k.removesuffix("_ms") for k in names))
        for r in rows:
            print(f"{r['tokens']} | " + " | ".join(f"{r[k]:.3f}" for k in names))
    save_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
