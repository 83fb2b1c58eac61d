"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM). Llama, with:
- the norms after each sublayer instead of before it: post_attention_layernorm on
  attention's output and post_feedforward_layernorm on the MLP's, each before its residual
  add, and no norm on a sublayer's input;
- RMSNorm over each token's whole query and key projections (all heads at once) before
  rotary;
- OLMo 3: sliding-window layers (the config's layer_types), with a rotary per layer type
  when the config keys its rope parameters so.
The q and k norms span every head, so tensor parallelism is refused at start (as is
fine-tuning, whose training pass is Llama's: model_checks.py). LoRA adapters are served.

EXAONE 4.0 (Exaone4ForCausalLM) has OLMo's post-sublayer norms with Qwen3's q and k norms
per head; with a sliding window, only its sliding layers (layer_types) have a rotary, the
full-attention ones none (NoPE). Tensor parallelism works there (norms per head).
"""
from __future__ import annotations

from torch import nn

from engine_actors.layers.norm import RMSNorm
from engine_actors.layers.rotary import rotary_per_layer_type
from engine_actors.model_checks import layer_window
from engine_actors.models.llama import AttentionOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP


class OlmoDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary, parallel, opts: AttentionOptions, window: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, parallel, opts, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, parallel)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # The stream is hidden + residual (the model's final norm adds them as it does
        # after Llama's layers): here the MLP's normed output, and the stream before it.
        x = hidden if residual is None else residual + hidden
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(x)), x


class Olmo2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True,
                                qk_norm_over_heads=True)

    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        return OlmoDecoderLayer(cfg, self.rotary, parallel, opts,
                                layer_window(cfg, i, max_positions))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def make_rotary(self, cfg, max_positions: int) -> nn.Module:
        return rotary_per_layer_type(cfg, max_positions)

    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        return OlmoDecoderLayer(cfg, self.rotary[cfg.layer_types[i]], parallel, opts,
                                layer_window(cfg, i, max_positions))


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        return AttentionOptions(qk_norm=True)

    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        rotary = self.rotary if cfg.sliding_window is None or \
            cfg.layer_types[i] == "sliding_attention" else None
        return OlmoDecoderLayer(cfg, rotary, parallel, opts,
                                layer_window(cfg, i, max_positions))
