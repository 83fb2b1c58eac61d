"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts; each expert is a SwiGLU MLP of its own.

All tokens of the iteration go through it at once, as through any other op: their (token,
expert) pairs are sorted by expert, so that each expert's rows are contiguous, and every
expert's matmul runs in one grouped matmul (torch._grouped_mm) over those row ranges; the
outputs, weighted by the router's probabilities, are put back in token order and each
token's k of them summed in fp32 (as transformers' grouped path: deterministic, unlike
atomic adds, and rounded once). Nothing reads the device on the host, so a step with
experts is captured in a CUDA graph like any other. Where the grouped matmul has no kernel
(fp32 and fp16 on CUDA; fp32 is what the GPU parity tests use: serve experts in bf16),
every expert runs on all rows and keeps its own, the same arithmetic at E times the cost.

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
        num_experts = self.gate.shape[0]
        probs = torch.softmax(F.linear(x, self.gate).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_dtype:
            weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, expert) pairs by expert
        tokens = order // self.top_k
        counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        ends = counts.cumsum(0).to(torch.int32)
        hidden = act_mul(grouped_mm(x[tokens], self.w13, ends, flat[order]))
        out = grouped_mm(hidden, self.w2, ends, flat[order])  # [T k, H], by expert
        by_token = torch.empty_like(order)  # the inverse permutation (a scatter, no sort)
        by_token[order] = torch.arange(order.shape[0], device=x.device)
        out = out[by_token].view(x.shape[0], self.top_k, -1)
        total = (out.float() * weights.float()[:, :, None]).sum(dim=1)
        return self.parallel.all_reduce(total.to(x.dtype))

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


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor,
               expert_of_row: torch.Tensor) -> torch.Tensor:
    """a [N, K] whose rows are grouped by expert (group e ends at ends[e]), w [E, M, K] ->
    [N, M]: each row times its expert's w[e]^T."""
    if not a.is_cuda or a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
    out = a.new_zeros(a.shape[0], w.shape[1])
    for e in range(w.shape[0]):  # (no grouped kernel: each expert on all rows, its kept)
        out = torch.where((expert_of_row == e)[:, None], a @ w[e].t(), out)
    return out
