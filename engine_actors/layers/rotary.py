from __future__ import annotations

import torch
from torch import nn

from engine_actors.plain_config import transformers_config
from kernels.rotary import rotary


def inverse_frequencies(hf_config, rope: dict | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the attention scaling of cos and sin). `rope`:
    the rope parameters to use (Gemma 3 has one set per layer type), else the config's."""
    if rope is None:
        rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} rescales with sequence length at run time "
                         "and is not supported; supported: default, linear, llama3, yarn")
    if rope_type in ("default", "linear"):  # linear: the default frequencies / factor
        dim = getattr(hf_config, "head_dim", None) \
            or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq / (rope["factor"] if rope_type == "linear" else 1.0), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rope_type](transformers_config(hf_config))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from the checkpoint's rope config.

    The inverse frequencies (and any rope scaling, e.g. llama3's) are computed as
    transformers' Llama rotary module computes them: its formula for "default", and its own
    functions for scaled variants. (Importing that module would import transformers'
    modeling stack: ~2 s of every worker's start.)
    """

    def __init__(self, hf_config, max_positions: int, rope: dict | None = None):
        super().__init__()
        inv_freq, scale = inverse_frequencies(hf_config, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotary(q, k, self.cos[positions], self.sin[positions])
