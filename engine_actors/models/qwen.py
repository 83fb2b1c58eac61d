"""Qwen2 / Qwen2.5 and Qwen3 (and Seed-OSS): Llama with different attention options.

Qwen2 has biases on q, k and v (not on o). Qwen3 normalises each query and key head with
RMSNorm before rotary, takes head_dim from its config, and has biases only if
`attention_bias` says so.
"""
from __future__ import annotations

from engine_actors.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


class SeedOssForCausalLM(LlamaForCausalLM):
    """ByteDance's Seed-OSS: Llama with q/k/v biases (attention_bias) and an o_proj bias of
    its own (attention_out_bias). Its dropouts are training's."""
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(cfg, "attention_bias", False)),
                                o_bias=bool(getattr(cfg, "attention_out_bias", False)))
