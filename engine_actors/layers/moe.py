"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts; each expert is a SwiGLU MLP of its own.

All tokens of the iteration go through it at once, as through any other op. On the GPU
each of the two matmuls is one fused launch over all experts (kernels/moe.py: the (token,
expert) pairs grouped by expert on the device, each expert's weights streamed once per
tile, the outputs written in pair order); on CPU, torch._grouped_mm over the pairs sorted
by expert. Each token's k outputs, weighted by the router's probabilities, are summed in
fp32 (as transformers' grouped path: deterministic, unlike atomic adds, and rounded
once). Nothing reads the device on the host, so a step with experts is captured in a CUDA
graph like any other.

Tensor parallelism splits each expert's intermediate features over the ranks, as a
column-then-row parallel MLP: the router is replicated, and the weighted sums are partial
sums, all-reduced at the end.

Built inside quantization.fp8_weights, the experts hold e4m3 weights with fp32 scales (per
block, or per row: `w13_scale`, `w2_scale`), as an FP8 checkpoint stores them or quantized
per row as they load. On the GPU the fused kernel widens each weight tile to the
activations' dtype as it loads (weights-only FP8: a decode step reads half the bytes); bf16
prompts quantize the activations too and multiply on FP8 tensor cores. On CPU the weights
are dequantized for each step, a reference path for tests. With an INT4 format the experts
are 4-bit (layers/moe_int4.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.int4_format import Int4Format
from engine_actors.layers.linear import cdiv, copy_checked
from engine_actors.layers.moe_int4 import Int4Experts
from engine_actors.parallel import SINGLE, ParallelGroup, shard_range
from engine_actors.quantization import building_format, quantize_weight_rows
from kernels.fp8 import dequantize
from kernels.fp8_quantize import FP8
from kernels.act_mul import act_mul
from kernels.moe import align_pairs, block_rows, expert_matmul

# FP8 experts' block rows from which activations are quantized too (W8A8): a step with more
# than 8 pairs per expert, where the tensor cores, not the weights' bytes, bound it
# (BENCHMARKS.md, 2026-11-29)
W8A8_ROWS = 64
# checkpoint names of an expert's projections (Qwen's; Mixtral's w1, w3, w2) -> Qwen's
NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
         "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class SparseMoE(Int4Experts, nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 norm_topk: bool, weights_in_dtype: bool, parallel: ParallelGroup = SINGLE):
        """norm_topk: the k probabilities are renormalized to sum to 1; weights_in_dtype:
        they are rounded to the activations' dtype before weighting (Qwen3-MoE's; Mixtral
        weights in fp32)."""
        super().__init__()
        self.parallel, self.top_k = parallel, top_k
        self.norm_topk, self.weights_in_dtype = norm_topk, weights_in_dtype
        self.inter = inter
        self.inter_start, local = shard_range(inter, parallel.tp_rank, parallel.tp_size)
        self.local = local
        self.gate = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.quant = building_format()
        self.int4 = isinstance(self.quant, Int4Format)
        if self.int4:
            self.make_int4(num_experts, hidden, inter, local)
            return
        dtype = FP8 if self.quant is not None else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, local, dtype=dtype),
                               requires_grad=False)
        if self.quant is not None:
            self.w13_scale, self.w2_scale = (
                nn.Parameter(torch.empty(num_experts, *self.scale_shape(*w.shape[1:]),
                                         dtype=torch.float32), requires_grad=False)
                for w in (self.w13, self.w2))
            self.check_blocks(inter, local)

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        return (cdiv(n, self.quant.block[0]), cdiv(k, self.quant.block[1])) if self.quant.block \
            else (n,)

    def check_blocks(self, inter: int, local: int) -> None:
        """Gate's and up's rows stack in w13 by whole blocks; a rank's share of the down
        projection's columns starts on a block."""
        if self.quant.block is None:
            return
        rows, cols = self.quant.block
        if local % rows or self.inter_start % rows or self.inter_start % cols or (
                local % cols and self.inter_start + local < inter):
            raise ValueError(f"FP8 weight blocks of {list(self.quant.block)} do not divide this "
                             f"model's experts' {inter} intermediate features into whole "
                             f"blocks (a rank's {local} from {self.inter_start})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.parallel.all_reduce(self.routed(x).to(x.dtype))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the experts' weighted sum [T, H] in fp32 (this rank's partial sum)."""
        num_experts = self.gate.shape[0]
        probs = torch.softmax(F.linear(x, self.gate).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_dtype:
            weights = weights.to(x.dtype)
        if x.is_cuda:  # one fused launch per matmul (kernels/moe.py), in pair order
            num_pairs = experts.numel()
            block_m = block_rows(num_pairs, num_experts)
            pair_ids, block_experts = align_pairs(experts, num_experts, block_m)
            block = self.quant.block if self.quant is not None and not self.int4 else None
            # FP8 prompts (bf16) on FP8 tensor cores, activations quantized per token and group
            w8a8 = self.quant is not None and not self.int4 and x.dtype == torch.bfloat16 \
                and block_m >= W8A8_ROWS
            hidden = act_mul(expert_matmul(x, self.w13, pair_ids, block_experts, num_pairs,
                                           self.top_k, block_m, scales=self.scales("w13"),
                                           block=block, quantize_a=w8a8,
                                           int4=self.int4_args("w13")))
            out = expert_matmul(hidden, self.w2, pair_ids, block_experts, num_pairs, 1, block_m,
                                scales=self.scales("w2"), block=block, quantize_a=w8a8,
                                int4=self.int4_args("w2"))
        else:
            out = grouped_experts(x, *(self.dequantized(w, x.dtype) for w in ("w13", "w2")),
                                  experts)
        out = out.view(x.shape[0], self.top_k, -1)
        return (out.float() * weights.float()[:, :, None]).sum(dim=1)

    def scales(self, name: str) -> torch.Tensor | None:
        return getattr(self, f"{name}_scale") if self.quant is not None else None

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The experts' weights `name` in dtype (FP8 or INT4 ones times their scales)."""
        w = getattr(self, name)
        if self.int4:
            return self.int4_dequantized(name, dtype)
        return w if self.quant is None else \
            dequantize(w, self.scales(name), self.quant.block, dtype)

    def load_checkpoint(self, name: str, tensor: torch.Tensor) -> list[str]:
        """`name`: "gate" (the router), "<expert>.<projection>" of one expert (its weight),
        "<expert>.<projection>.weight_scale" (an FP8 checkpoint's scales), or "gate_up_proj"
        / "down_proj" of all experts stacked (transformers 5's own layout); returns the keys
        it filled (checkpoint_keys')."""
        if name == "gate":
            check_unquantized(name, tensor)
            copy_checked(self.gate.data, tensor)
            return [name]
        experts = range(self.gate.shape[0])
        if tensor.shape[0] != len(experts) and name in ("gate_up_proj", "down_proj"):
            raise ValueError(f"{name} holds {tensor.shape[0]} experts, the model "
                             f"{len(experts)}")
        if name == "gate_up_proj":  # [E, 2I, H]: gate's rows, then up's
            inter = tensor.shape[1] // 2
            return [key for e in experts for key in (
                self.load_checkpoint(f"{e}.gate_proj", tensor[e, :inter]) +
                self.load_checkpoint(f"{e}.up_proj", tensor[e, inter:]))]
        if name == "down_proj":  # [E, H, I]
            return [key for e in experts
                    for key in self.load_checkpoint(f"{e}.down_proj", tensor[e])]
        expert, projection, *scale = name.split(".")
        projection, e = NAMES[projection], int(expert)
        if e >= self.gate.shape[0]:
            raise ValueError(f"expert {expert} of a model with {self.gate.shape[0]}")
        if self.int4:
            return [self.load_int4(e, projection, scale[0] if scale else "weight", tensor)]
        if scale and scale[0] != "weight_scale":
            raise ValueError(f"expert {e}'s {projection} has a {scale[0]} tensor, which is "
                             "not served for FP8 experts")
        if scale:
            self.load_scale(e, projection, tensor)
            return [f"{expert}.{projection}.weight_scale"]
        if self.quant is not None and not self.quant.online and tensor.dtype != FP8:
            raise ValueError(f"an FP8 checkpoint's expert weight is stored as {tensor.dtype}, "
                             "not float8_e4m3fn")
        w, rows, start = self.destination(projection)
        src = tensor.narrow(*rows) if projection != "down_proj" else \
            tensor.narrow(1, self.inter_start, self.w2.shape[2])
        if self.quant is not None and self.quant.online:  # one scale per row of this rank's part
            src, scales = quantize_weight_rows(src)
            getattr(self, f"{w}_scale").data[e].narrow(0, start, src.shape[0]).copy_(scales)
        copy_checked(getattr(self, w).data[e].narrow(0, start, src.shape[0]), src)
        return [f"{expert}.{projection}"]

    def destination(self, projection: str) -> tuple[str, tuple[int, int, int], int]:
        """(the weights a projection goes to, its full tensor's rows held here as narrow's
        (dim, start, length), the first of its rows there): gate's and up's rows [I, H] are
        this rank's halves of w13; the down projection [H, I] is w2."""
        local = self.local
        if projection == "down_proj":
            return "w2", (0, 0, self.w2.shape[1]), 0
        part = 0 if projection == "gate_proj" else 1
        return "w13", (0, self.inter_start, local), part * local

    def load_scale(self, e: int, projection: str, tensor: torch.Tensor) -> None:
        """An FP8 checkpoint's scales of one expert's projection: per block (this rank's
        rows of blocks, or columns for the down projection), per row or per tensor."""
        if self.quant is None or self.quant.online:
            raise ValueError(f"a scale of expert {e}'s {projection} in a checkpoint that is "
                             "not FP8")
        w, (_, first, length), start = self.destination(projection)
        dst = getattr(self, f"{w}_scale").data[e]
        hidden = self.gate.shape[1]
        n, k = (hidden, self.inter) if projection == "down_proj" else (self.inter, hidden)
        expected = self.scale_shape(n, k)  # the whole projection's: per block, or per row
        if (tuple(tensor.shape) != expected) if self.quant.block else tensor.numel() not in (1, n):
            raise ValueError(f"expert {e}'s {projection} scale has shape "
                             f"{tuple(tensor.shape)}, not {expected}"
                             + " (or one per tensor)" * (self.quant.block is None))
        if self.quant.block is not None:
            rows, cols = self.quant.block
            if projection == "down_proj":
                copy_checked(dst, tensor.narrow(1, self.inter_start // cols, dst.shape[1]))
            else:
                copy_checked(dst.narrow(0, start // rows, cdiv(length, rows)),
                             tensor.narrow(0, first // rows, cdiv(length, rows)))
            return
        full = self.inter if w == "w13" else length
        tensor = tensor.reshape(-1).expand(full) if tensor.numel() == 1 else tensor.reshape(-1)
        copy_checked(dst.narrow(0, start, length), tensor.narrow(0, first, length))

    def checkpoint_keys(self) -> list[str]:
        """What a complete checkpoint fills: the router and each expert's projections."""
        projections = ("gate_proj", "up_proj", "down_proj")
        scaled = self.quant is not None and not self.quant.online
        suffixes = ("", ".weight_scale", ".weight_zero_point")[
            :1 + scaled + (self.int4 and self.quant.zero_points)]
        return ["gate"] + [f"{e}.{p}{suffix}" for e in range(self.gate.shape[0])
                           for p in projections for suffix in suffixes]


def check_unquantized(name: str, tensor: torch.Tensor) -> None:
    """A router (or shared-expert gate) stays in the model's dtype: a quantized one (every
    Linear targeted, the router included) is refused, not loaded without its scale."""
    if tensor.dtype == FP8 or not tensor.is_floating_point():
        raise ValueError(f"the mixture of experts' {name} is quantized ({tensor.dtype}); "
                         "served: a router left out of the quantization (its ignore list)")


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """The experts on CPU: the (token, expert) pairs sorted by expert, one grouped matmul
    (torch._grouped_mm) per projection over each expert's rows, put back in pair order:
    x [T, H], experts [T, k] -> [T k, H]."""
    top_k, flat = experts.shape[1], experts.flatten()
    order = torch.argsort(flat, stable=True)
    ends = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    hidden = act_mul(torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=ends))
    out = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=ends)
    by_pair = torch.empty_like(out)
    by_pair[order] = out
    return by_pair
