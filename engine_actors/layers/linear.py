"""Linear layers whose parameters know how to load themselves from checkpoint tensors.

`MergedLinear` stacks several checkpoint projections (q/k/v, or gate/up) into one matmul;
each checkpoint tensor lands in its slice of the output dimension.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        param = getattr(self, name)
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                             f"{tuple(tensor.shape)}")
        param.data.copy_(tensor)


class MergedLinear(Linear):
    """One matmul for several projections of the same input; output = concat of parts."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(part_sizes), bias)
        self.part_sizes = part_sizes

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        assert shard is not None, "a merged linear loads one part at a time"
        start = sum(self.part_sizes[:shard])
        part = getattr(self, name).data.narrow(0, start, self.part_sizes[shard])
        if part.shape != tensor.shape:
            raise ValueError(f"shape mismatch: part {shard} {tuple(part.shape)} vs checkpoint "
                             f"{tuple(tensor.shape)}")
        part.copy_(tensor)
