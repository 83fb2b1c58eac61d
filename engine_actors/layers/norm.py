from __future__ import annotations

import torch
from torch import nn

from kernels.rmsnorm import rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        """unit_offset: Gemma's norm, whose weight multiplies as 1 + weight."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        return rmsnorm(x, self.weight, self.eps, residual, self.unit_offset)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        self.weight.data.copy_(tensor)
