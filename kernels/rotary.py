"""Rotary position embedding (the rotate-half form of Llama / GPT-NeoX), per-token positions."""
from __future__ import annotations

import torch


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, Hq, D], k [T, Hkv, D]; cos, sin [T, D/2] for each token's own position.

    Each request's positions restart at 0 (TCB's per-request positional encoding), so the
    caller gathers cos/sin rows by position; this function never sees request boundaries.
    """
    cos = torch.cat((cos, cos), dim=-1)[:, None, :].to(q.dtype)  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :].to(q.dtype)

    def rotate(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    return rotate(q), rotate(k)


def rotary(q, k, cos, sin):
    return rotary_ref(q, k, cos, sin)
