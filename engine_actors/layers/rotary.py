from __future__ import annotations

import torch
from torch import nn

from kernels.rotary import rotary


def inverse_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the attention scaling of cos and sin)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} rescales with sequence length at run time "
                         "and is not supported; supported: default, linear, llama3, yarn")
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) \
            or hf_config.hidden_size // hf_config.num_attention_heads
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from the checkpoint's rope config.

    The inverse frequencies (and any rope scaling, e.g. llama3's) are computed as
    transformers' Llama rotary module computes them: its formula for "default", and its own
    functions for scaled variants. (Importing that module would import transformers'
    modeling stack: ~2 s of every worker's start.)
    """

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        inv_freq, scale = inverse_frequencies(hf_config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotary(q, k, self.cos[positions], self.sin[positions])
