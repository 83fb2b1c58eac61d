"""One mixture-of-experts layer's experts (both matmuls and the activation, routing given)
at several token counts: the fused Triton kernel (kernels/moe.py) under each config, and
torch._grouped_mm over pairs sorted by expert (what the layer ran before it), each in a CUDA
graph, against the floor of reading the weights of the experts the routing touches. Then the
fused kernel's default config on the same weights in e4m3 (FP8 checkpoints, `quantization:
fp8`), with a scale per row and per 128 x 128 block, against the e4m3 floor (half the bytes),
and in INT4 (W4A16, groups of 128: GPTQ, AWQ and compressed-tensors checkpoints), against
the INT4 floor (a quarter of the bytes); --int4-sweep tries each SWEEP config for INT4 (its
BLOCK_N is always the weights' tile, 128).

    python -m load_tests.bench_moe --shape qwen3-30b-a3b --tokens 1 16 64 256 2048
"""
from __future__ import annotations

import argparse

import torch

from engine_actors.layers.moe import W8A8_ROWS
from kernels.act_mul import act_mul
from kernels.fp8_quantize import FP8, FP8_MAX
from kernels.int4_layout import by_group, tile_experts
from kernels.moe import CONFIGS, align_pairs, block_rows, expert_matmul
from load_tests.bench_rows import graph_ms
from load_tests.gpu_ceilings import copy_bandwidth_gbs
from load_tests.report import save_json

# hidden, intermediate, experts, top_k
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
# block_m, then the kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages)
SWEEP = [(16, (64, 128, 4, 3)), (16, (32, 128, 4, 3)), (16, (64, 256, 4, 3)),
         (16, (128, 128, 4, 3)), (16, (64, 128, 4, 5)),
         (64, (128, 64, 4, 3)), (64, (64, 64, 4, 4)), (64, (128, 128, 4, 3)),
         (64, (128, 64, 8, 4)),
         (128, (128, 64, 8, 3)), (128, (128, 64, 8, 4)), (128, (256, 64, 8, 3)),
         (128, (128, 128, 8, 3)), (128, (64, 64, 4, 4))]
# FP8 weights' configs (BLOCK_K: the activations' group, with W8A8; 0 there)
FP8_SWEEP = [(16, (64, 128, 4, 3)), (16, (32, 128, 4, 3)), (16, (64, 256, 4, 3)),
             (16, (128, 128, 4, 3)), (16, (64, 128, 4, 5)),
             (64, (128, 0, 4, 3)), (64, (64, 0, 4, 3)), (64, (128, 0, 8, 3)), (64, (256, 0, 8, 3)),
             (128, (128, 0, 8, 3)), (128, (128, 0, 4, 3)), (128, (256, 0, 8, 3)),
             (128, (64, 0, 4, 4)), (128, (128, 0, 8, 4))]


def fused(x, w13, w2, experts, block_m, config=None, fp8=None, int4=None):
    """fp8: (w13's scales, w2's, block or None) for e4m3 weights, whose activations are
    quantized too (W8A8) from W8A8_ROWS block rows on, as the layer does; int4: (w13's
    scales, w2's, group) for INT4 weights."""
    num_pairs, top_k = experts.numel(), experts.shape[1]
    pair_ids, block_experts = align_pairs(experts, w13.shape[0], block_m)
    s13, s2, block = fp8 or int4 or (None, None, None)
    w8a8 = fp8 is not None and block_m >= W8A8_ROWS
    groups = (None, None) if int4 is None else ((int4[2], None, 4), (int4[2], None, 4))
    hidden = act_mul(expert_matmul(x, w13, pair_ids, block_experts, num_pairs, top_k,
                                   block_m, config, scales=s13, block=fp8 and block,
                                   quantize_a=w8a8, int4=groups[0]))
    return expert_matmul(hidden, w2, pair_ids, block_experts, num_pairs, 1, block_m, config,
                         scales=s2, block=fp8 and block, quantize_a=w8a8, int4=groups[1])


def int4_quantized(w: torch.Tensor, group: int):
    """w [E, N, K] as INT4 words [E, N, K / 8] with fp32 scales per group [E, N, K / group]
    (symmetric, round to nearest); and w dequantized back (bf16)."""
    e, n, k = w.shape
    g = w.float().view(e, n, k // group, group)
    scales = g.abs().amax(-1) / 7
    q = (g / scales[..., None]).round().clamp(-8, 7)
    nibbles = (q.to(torch.int32) + 8).view(e, n, k // 8, 8)
    words = sum(nibbles[..., i] << (4 * i) for i in range(8)).to(torch.int32)
    return words, scales, (q * scales[..., None]).view(e, n, k).to(w.dtype)


def quantized(w: torch.Tensor, block: tuple[int, int] | None):
    """w [E, N, K] in e4m3 with fp32 scales: per row ([E, N]) or per block ([E, N/b, K/b]);
    and w dequantized back (bf16), what the e4m3 weights mean."""
    e, n, k = w.shape
    if block is None:
        scales = w.abs().amax(2).float() / FP8_MAX
        full = scales[:, :, None]
    else:
        b0, b1 = block
        scales = w.view(e, n // b0, b0, k // b1, b1).abs().amax((2, 4)).float() / FP8_MAX
        full = scales.repeat_interleave(b0, 1).repeat_interleave(b1, 2)
    q = (w.float() / full).to(FP8)
    return q, scales, (q.float() * full).to(w.dtype)


def grouped(x, w13, w2, experts):
    top_k, flat = experts.shape[1], experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)
    hidden = act_mul(torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=ends))
    out = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=ends)
    by_pair = torch.empty_like(out)
    by_pair[order] = out
    return by_pair


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--no-sweep", action="store_true", help="the default config only")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="every FP8_SWEEP config of the size's block rows, e4m3 weights")
    ap.add_argument("--int4-sweep", action="store_true",
                    help="every SWEEP config of the size's block rows, INT4 weights")
    ap.add_argument("--out")
    args = ap.parse_args()
    hidden, inter, num_experts, top_k = SHAPES[args.shape]
    torch.manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / 50
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / 50
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    bandwidth = copy_bandwidth_gbs()
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        experts = torch.rand(tokens, num_experts, device="cuda").topk(top_k, dim=-1).indices
        touched = experts.unique().numel()
        floor = touched * expert_bytes / bandwidth / 1e6
        ref = grouped(x, w13, w2, experts)
        row = {"tokens": tokens, "experts_touched": touched, "floor_ms": floor,
               "grouped_ms": graph_ms(lambda: grouped(x, w13, w2, experts))}
        block_m = block_rows(experts.numel(), num_experts)
        for bm, config in [(block_m, None)] + SWEEP * (not args.no_sweep):
            out = fused(x, w13, w2, experts, bm, config)
            err = (out.float() - ref.float()).abs().max().item()
            ms = graph_ms(lambda: fused(x, w13, w2, experts, bm, config))
            row.setdefault("fused_ms", {})[str((bm, config))] = ms
            row.setdefault("max_abs_diff", {})[str((bm, config))] = err
        # the default's parts: routing's alignment, then the two matmuls and the activation
        pair_ids, block_experts = align_pairs(experts, num_experts, block_m)
        gate_up = expert_matmul(x, w13, pair_ids, block_experts, experts.numel(), top_k, block_m)
        act = act_mul(gate_up)
        row["parts_ms"] = {
            "align": graph_ms(lambda: align_pairs(experts, num_experts, block_m)),
            "gate_up": graph_ms(lambda: expert_matmul(x, w13, pair_ids, block_experts,
                                                      experts.numel(), top_k, block_m)),
            "act": graph_ms(lambda: act_mul(gate_up)),
            "down": graph_ms(lambda: expert_matmul(act, w2, pair_ids, block_experts,
                                                   experts.numel(), 1, block_m))}
        for name, block in (("fp8_rows", None), ("fp8_blocks", (128, 128))):
            (q13, s13, d13), (q2, s2, d2) = quantized(w13, block), quantized(w2, block)
            fp8 = (s13, s2, block)
            out = fused(x, q13, q2, experts, block_m, fp8=fp8)
            want = fused(x, d13, d2, experts, block_m)  # bf16 over the dequantized weights
            row[f"{name}_ms"] = graph_ms(lambda: fused(x, q13, q2, experts, block_m, fp8=fp8))
            row[f"{name}_max_abs_diff"] = (out.float() - want.float()).abs().max().item()
            for bm, config in FP8_SWEEP * args.fp8_sweep:
                if bm == block_m:
                    row.setdefault(f"{name}_sweep_ms", {})[str(config)] = graph_ms(
                        lambda: fused(x, q13, q2, experts, bm, config, fp8))
            del q13, q2, d13, d2
        (q13, s13, d13), (q2, s2, d2) = int4_quantized(w13, 128), int4_quantized(w2, 128)
        q13, q2 = tile_experts(q13), tile_experts(q2)  # (as the layer stores them)
        int4 = (by_group(s13), by_group(s2), 128)
        out = fused(x, q13, q2, experts, block_m, int4=int4)
        want = fused(x, d13, d2, experts, block_m)
        row["int4_ms"] = graph_ms(lambda: fused(x, q13, q2, experts, block_m, int4=int4))
        row["int4_max_abs_diff"] = (out.float() - want.float()).abs().max().item()
        for bm, config in SWEEP * args.int4_sweep:
            if bm == block_m:
                row.setdefault("int4_sweep_ms", {})[str(config)] = graph_ms(
                    lambda: fused(x, q13, q2, experts, bm, config, int4=int4))
        del q13, q2, d13, d2
        row["floor_int4_ms"] = floor / 4
        row["floor_fp8_ms"] = floor / 2
        default = row["fused_ms"][str((block_m, None))]
        best = min(row["fused_ms"].items(), key=lambda kv: kv[1])
        print(f"tokens {tokens:5d} block_m {block_m} experts {touched:3d}: floor {floor:.3f} ms"
              f" | grouped_mm {row['grouped_ms']:.3f} | fused {default:.3f} (default"
              f" {CONFIGS[block_m]}) | best {best[1]:.3f} {best[0]}"
              f" | max diff {max(row['max_abs_diff'].values()):.2e}"
              f" | e4m3 floor {floor / 2:.3f} rows {row['fp8_rows_ms']:.3f} blocks"
              f" {row['fp8_blocks_ms']:.3f} (diff {row['fp8_rows_max_abs_diff']:.1e},"
              f" {row['fp8_blocks_max_abs_diff']:.1e})"
              f" | int4 floor {floor / 4:.3f} int4 {row['int4_ms']:.3f}"
              f" (diff {row['int4_max_abs_diff']:.1e})"
              + "".join(f" | best {n} {min(sw.items(), key=lambda kv: kv[1])}"
                        for n in ("fp8_rows", "fp8_blocks", "int4")
                        if (sw := row.get(f"{n}_sweep_ms")))
              + " | parts "
              + " ".join(f"{k} {v:.3f}" for k, v in row["parts_ms"].items()), flush=True)
        rows.append(row)
    save_json(args.out, {"shape": args.shape, "bandwidth_gbs": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
