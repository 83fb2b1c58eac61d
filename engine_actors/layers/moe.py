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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.layers.linear import copy_checked
from engine_actors.parallel import SINGLE, ParallelGroup, shard_range
from kernels.act_mul import act_mul
from kernels.moe import align_pairs, block_rows, expert_matmul

# checkpoint names of an expert's projections (Qwen's; Mixtral's w1, w3, w2) -> Qwen's
NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
         "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 norm_topk: bool, weights_in_dtype: bool, parallel: ParallelGroup = SINGLE):
        """norm_topk: the k probabilities are renormalized to sum to 1; weights_in_dtype:
        they are rounded to the activations' dtype before weighting (Qwen3-MoE's; Mixtral
        weights in fp32)."""
        super().__init__()
        self.parallel, self.top_k = parallel, top_k
        self.norm_topk, self.weights_in_dtype = norm_topk, weights_in_dtype
        self.inter_start, local = shard_range(inter, parallel.tp_rank, parallel.tp_size)
        self.gate = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, local), requires_grad=False)

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
            hidden = act_mul(expert_matmul(x, self.w13, pair_ids, block_experts, num_pairs,
                                           self.top_k, block_m))
            out = expert_matmul(hidden, self.w2, pair_ids, block_experts, num_pairs, 1, block_m)
        else:
            out = grouped_experts(x, self.w13, self.w2, experts)
        out = out.view(x.shape[0], self.top_k, -1)
        return (out.float() * weights.float()[:, :, None]).sum(dim=1)

    def load_checkpoint(self, name: str, tensor: torch.Tensor) -> list[str]:
        """`name`: "gate" (the router), "<expert>.<projection>" of one expert, or
        "gate_up_proj" / "down_proj" of all experts stacked (transformers 5's own layout);
        returns the keys it filled (checkpoint_keys')."""
        if name == "gate":
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
        expert, projection = name.split(".")
        projection, local = NAMES[projection], self.w2.shape[2]
        if int(expert) >= self.gate.shape[0]:
            raise ValueError(f"expert {expert} of a model with {self.gate.shape[0]}")
        if projection == "down_proj":  # [H, I]: this rank's input columns
            copy_checked(self.w2.data[int(expert)], tensor.narrow(1, self.inter_start, local))
        else:  # [I, H]: this rank's output rows, into gate's or up's half of w13
            part = 0 if projection == "gate_proj" else 1
            copy_checked(self.w13.data[int(expert)].narrow(0, part * local, local),
                  tensor.narrow(0, self.inter_start, local))
        return [f"{expert}.{projection}"]

    def checkpoint_keys(self) -> list[str]:
        """What a complete checkpoint fills: the router and each expert's projections."""
        projections = ("gate_proj", "up_proj", "down_proj")
        return ["gate"] + [f"{e}.{p}" for e in range(self.gate.shape[0]) for p in projections]


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
