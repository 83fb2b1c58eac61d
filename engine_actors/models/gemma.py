"""Gemma 2 and Gemma 3. Gemma 3's text model: Gemma3ForCausalLM (gemma-3-270m and
gemma-3-1b), and the text model of Gemma3ForConditionalGeneration (the 4B, 12B and 27B
releases; their vision tower is not loaded: text only). Llama, with:
- norms whose weight multiplies as 1 + weight, in fp32 (RMSNorm's unit_offset), on the
  queries and keys of each head too (Gemma 3, as Qwen3's);
- four norms per layer: after attention and after the MLP, besides the two before them;
- GELU (tanh approximation) in the MLP, embeddings scaled by sqrt(hidden_size), attention
  scores by query_pre_attn_scalar ** -0.5;
- sliding-window layers (the config's layer_types), in Gemma 3 with a rotary of their own
  (a lower rope_theta) apart from the full-attention layers';
- Gemma 2: soft-capped attention scores (in the attention kernel) and final logits.
"""
from __future__ import annotations

import torch
from torch import nn

from engine_actors.layers.norm import RMSNorm
from engine_actors.layers.rotary import RotaryEmbedding, rotary_per_layer_type
from engine_actors.model_checks import layer_window
from engine_actors.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP
from kernels.act_mul import act_mul


class GemmaMLP(LlamaMLP):
    def forward(self, x):
        return self.down_proj(act_mul(self.gate_up_proj(x), "gelu_tanh"))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, parallel, opts: AttentionOptions,
                 window: int = 0):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.self_attn = LlamaAttention(cfg, rotary, parallel, opts, window)
        self.post_attention_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.mlp = GemmaMLP(cfg, parallel)
        self.post_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # The residual add of the previous sublayer is fused into the next pre-norm.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    unit_offset = True

    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias,
                                scale=cfg.query_pre_attn_scalar ** -0.5,
                                softcap=cfg.attn_logit_softcapping or 0.0)

    def make_rotary(self, cfg, max_positions: int) -> nn.Module:
        """The rotary of each layer type: one for all (Gemma 2), or one per type (Gemma 3)."""
        return rotary_per_layer_type(cfg, max_positions)

    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        return GemmaDecoderLayer(cfg, self.rotary[cfg.layer_types[i]], parallel, opts,
                                 layer_window(cfg, i, max_positions))

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """A multimodal checkpoint's text model is under `language_model.` (as released)
        or `model.language_model.` (as transformers 5 may write it); its vision tower and
        projector are for no module here."""
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
        return super().load_weight(name.removeprefix("language_model."), tensor)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden_size), that factor rounded to their dtype (as
        transformers' Gemma)."""
        hidden = self.embed_tokens(input_ids)
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype).item()
        return hidden * scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final logits soft-capped (final_logit_softcapping: c tanh(x / c), in the model's
        dtype, as transformers' Gemma 2), then fp32."""
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return (cap * torch.tanh(logits / cap) if cap else logits).float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True, unit_offset=True,
                                scale=cfg.query_pre_attn_scalar ** -0.5)


