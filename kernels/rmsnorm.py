"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None):
    """x [T, H]. Without residual returns norm(x); with it returns (norm(x + r), x + r).

    Computed in fp32 and cast back before the weight multiply, as transformers' Llama does.
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rmsnorm(x, weight, eps, residual=None):
    return rmsnorm_ref(x, weight, eps, residual)
