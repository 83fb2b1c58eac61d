"""Tensor-parallel linear layers; each parameter loads its own shard of a full checkpoint tensor.

ColumnParallelLinear splits the output features over the stage's ranks, and may stack several
checkpoint projections (q/k/v, gate/up) into one matmul. Each part is split by heads, and a
part with fewer heads than ranks (GQA's K/V with tp_size > num_kv_heads) is replicated.
RowParallelLinear splits the input features and all-reduces the partial sums. With tp_size 1
both are plain linears.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.parallel import SINGLE, ParallelGroup, shard_range


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint "
                         f"{tuple(src.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool = False,
                 parallel: ParallelGroup = SINGLE):
        """parts: (num_heads, head_size) of each stacked projection; a plain linear is
        [(out_features, 1)]."""
        super().__init__()
        self.parallel = parallel
        self.parts = parts
        # rows of each part held here: heads split evenly, or one replicated head
        self.local_heads = [heads // parallel.tp_size if heads >= parallel.tp_size else 1
                            for heads, _ in parts]
        self.part_sizes = [n * size for n, (_, size) in zip(self.local_heads, parts)]
        out = sum(self.part_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        part = shard or 0
        heads, head_size = self.parts[part]
        local = self.local_heads[part]
        if heads >= self.parallel.tp_size:
            first_head, _ = shard_range(heads, self.parallel.tp_rank, self.parallel.tp_size)
        else:  # replicated: ranks share heads in order
            first_head = self.parallel.tp_rank * heads // self.parallel.tp_size
        src = tensor.narrow(0, first_head * head_size, local * head_size)
        start = sum(self.part_sizes[:part])
        _copy(getattr(self, name).data.narrow(0, start, self.part_sizes[part]), src)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelGroup = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.in_start, local_in = shard_range(in_features, parallel.tp_rank, parallel.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.all_reduce(F.linear(x, self.weight))  # partial sums -> full
        return out if self.bias is None else out + self.bias

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if name == "bias":
            _copy(self.bias.data, tensor)
        else:
            _copy(self.weight.data, tensor.narrow(1, self.in_start, self.weight.shape[1]))
