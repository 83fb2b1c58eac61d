from __future__ import annotations

import torch
from torch import nn

from kernels.rmsnorm import rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        return rmsnorm(x, self.weight, self.eps, residual)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        self.weight.data.copy_(tensor)
