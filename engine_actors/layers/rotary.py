from __future__ import annotations

import torch
from torch import nn

from kernels.rotary import rotary


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from the checkpoint's rope config.

    The inverse frequencies (and any rope scaling, e.g. llama3's) come from transformers'
    own rotary module, so every rope variant it knows is computed exactly as it computes it.
    """

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} rescales with sequence length at run time "
                             "and is not supported; supported: default, linear, llama3, yarn")
        hf_rope = LlamaRotaryEmbedding(hf_config)
        inv_freq = hf_rope.inv_freq.float()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        scale = hf_rope.attention_scaling
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotary(q, k, self.cos[positions], self.sin[positions])
