"""Mixture-of-experts models: Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B),
Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and Mixtral
(MixtralForCausalLM). Their attention is Qwen3's, Qwen2's and Llama's (Mistral's); their
MLPs are sparse mixtures of experts (layers/moe.py): the Qwens' on the layers their
decoder_sparse_step and mlp_only_layers make sparse (their other layers are dense),
Mixtral's on all. Qwen2-MoE adds a shared expert that every token goes through, its output
scaled by a sigmoid gate of the token. Expert weights load from the checkpoint's per-expert
tensors. LoRA adapters apply to the attention and the dense MLP layers, never to experts;
fine-tuning is refused at start (engine_actors/model_checks.py).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.layers.linear import copy_checked
from engine_actors.layers.moe import SparseMoE, check_unquantized
from engine_actors.model_checks import layer_window, qwen_sparse_layer
from engine_actors.models.llama import (AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM,
                                        LlamaMLP)
from engine_actors.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from kernels.act_mul import act_mul

# model.layers.<i>.<mlp | block_sparse_moe>.<gate | shared_expert_gate>.weight,
# ....experts.<e>.<projection>.<weight | weight_scale_inv | weight_scale | input_scale> (an
# FP8 checkpoint's scales; a static activation scale is not used), or
# model.layers.<i>.mlp.experts.<gate_up_proj | down_proj> (all experts stacked)
EXPERT_WEIGHT = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                           r"(?:(gate|shared_expert_gate)\.weight|experts\.(\d+)\.(\w+)\."
                           r"(weight|weight_packed|weight_scale_inv|weight_scale|"
                           r"weight_zero_point|weight_g_idx|weight_shape|input_scale|input_zero_point)|"
                           r"experts\.(gate_up_proj|down_proj))")


# an expert tensor's kind as SparseMoE.load_checkpoint names it
EXPERT_SUFFIX = {"weight": "", "weight_packed": "", "weight_scale": ".weight_scale",
                 "weight_scale_inv": ".weight_scale", "weight_zero_point": ".weight_zero_point",
                 "weight_g_idx": ".weight_g_idx"}


class MoEWeights:
    """Loading of the router's and experts' tensors (a mixin of the models below)."""

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | list[str] | None:
        m = EXPERT_WEIGHT.fullmatch(name)
        if m is None:
            return super().load_weight(name, tensor)
        layer = self.layers[m[1]] if m[1] in self.layers else None
        if layer is None or not isinstance(layer.mlp, SparseMoE):
            return None  # another stage's layer
        if m[5] in ("input_scale", "input_zero_point", "weight_shape"):
            return None
        name = m[2] or m[6] or f"{m[3]}.{m[4]}" + EXPERT_SUFFIX[m[5]]
        return [f"layers.{m[1]}.mlp.{key}" for key in layer.mlp.load_checkpoint(name, tensor)]


class Qwen3MoeForCausalLM(MoEWeights, Qwen3ForCausalLM):
    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                        cfg.num_experts_per_tok, cfg.norm_topk_prob, True, parallel) \
            if qwen_sparse_layer(cfg, i) else None
        return LlamaDecoderLayer(cfg, self.rotary, parallel, opts,
                                 layer_window(cfg, i, max_positions), mlp)


class SharedExpertMoE(SparseMoE):
    """Qwen2-MoE's: the routed experts plus a shared expert (a SwiGLU MLP) scaled by
    sigmoid(shared_expert_gate(x)) per token. Under tensor parallelism the shared expert's
    partial sum joins the experts' before the one all-reduce."""

    def __init__(self, cfg, parallel):
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                         cfg.num_experts_per_tok, cfg.norm_topk_prob, True, parallel)
        self.shared_expert = LlamaMLP(cfg, parallel, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Parameter(torch.empty(1, cfg.hidden_size),
                                               requires_grad=False)  # (on every rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (the down projection's partial sum: one all-reduce below for both)
        shared = self.shared_expert.down_proj.matmul(act_mul(self.shared_expert.gate_up_proj(x)))
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate))
        total = self.routed(x) + (gate * shared).float()
        return self.parallel.all_reduce(total.to(x.dtype))

    def load_checkpoint(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name != "shared_expert_gate":
            return super().load_checkpoint(name, tensor)
        check_unquantized(name, tensor)
        copy_checked(self.shared_expert_gate.data, tensor)
        return [name]

    def checkpoint_keys(self) -> list[str]:
        return super().checkpoint_keys() + ["shared_expert_gate"]


class Qwen2MoeForCausalLM(MoEWeights, Qwen2ForCausalLM):
    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        return AttentionOptions(qkv_bias=getattr(cfg, "qkv_bias", True), o_bias=False)

    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        mlp = SharedExpertMoE(cfg, parallel) if qwen_sparse_layer(cfg, i) else None
        return LlamaDecoderLayer(cfg, self.rotary, parallel, opts,
                                 layer_window(cfg, i, max_positions), mlp)


class MixtralForCausalLM(MoEWeights, LlamaForCausalLM):
    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        mlp = SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                        cfg.num_experts_per_tok, True, False, parallel)
        return LlamaDecoderLayer(cfg, self.rotary, parallel, opts,
                                 layer_window(cfg, i, max_positions), mlp)
