"""IBM Granite 3.x (GraniteForCausalLM): Llama with four multipliers. Embeddings are scaled
by embedding_multiplier, attention scores by attention_multiplier (instead of
1 / sqrt(head_dim)), each sublayer's output by residual_multiplier before its residual add,
and the logits divided by logits_scaling. LoRA adapters are served; fine-tuning is refused
(its training pass is Llama's; engine_actors/model_checks.py).
"""
from __future__ import annotations

import torch

from engine_actors.model_checks import layer_window
from engine_actors.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def forward(self, positions, hidden, residual, kv_cache, meta):
        # The residual add of the previous sublayer is fused into the next norm: a
        # sublayer's output is scaled before it.
        scale = self.residual_multiplier
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta) * scale
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * scale, residual


class GraniteForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, scale=cfg.attention_multiplier)

    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        layer = GraniteDecoderLayer(cfg, self.rotary, parallel, opts,
                                    layer_window(cfg, i, max_positions))
        layer.residual_multiplier = cfg.residual_multiplier
        return layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Divided in the model's dtype, then fp32 (as transformers' Granite)."""
        return (self.lm_head(hidden) / self.config.logits_scaling).float()
