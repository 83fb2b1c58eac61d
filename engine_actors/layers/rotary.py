from __future__ import annotations

import torch
from torch import nn

from engine_actors.plain_config import transformers_config
from kernels.rotary import rotary


def inverse_frequencies(hf_config, layer_type: str | None = None
                        ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], the attention scaling of cos and sin).
    layer_type: the layer type whose rope parameters apply (Gemma 3 and OLMo 3 key them by
    layer type), else the config's."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        rope = rope[layer_type]
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
    return ROPE_INIT_FUNCTIONS[rope_type](transformers_config(hf_config),
                                          **({"layer_type": layer_type} if layer_type else {}))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, from the checkpoint's rope config.

    The inverse frequencies (and any rope scaling, e.g. llama3's) are computed as
    transformers' Llama rotary module computes them: its formula for "default", and its own
    functions for scaled variants. (Importing that module would import transformers'
    modeling stack: ~2 s of every worker's start.)
    """

    def __init__(self, hf_config, max_positions: int, layer_type: str | None = None):
        super().__init__()
        inv_freq, scale = inverse_frequencies(hf_config, layer_type)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotary(q, k, self.cos[positions], self.sin[positions])


def rotary_per_layer_type(hf_config, max_positions: int) -> nn.ModuleDict:
    """The rotary of each of the config's layer_types: one shared by all, or one per type
    with its own rope parameters (transformers 5 keys them by layer type: Gemma 3, OLMo 3)."""
    kinds = sorted(set(hf_config.layer_types))
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if not any(kind in rope for kind in kinds):
        shared = RotaryEmbedding(hf_config, max_positions)
        return nn.ModuleDict({kind: shared for kind in kinds})
    return nn.ModuleDict({kind: RotaryEmbedding(hf_config, max_positions, kind)
                          for kind in kinds})
