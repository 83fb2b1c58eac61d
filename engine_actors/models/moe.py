"""Mixture-of-experts models: Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B)
and Mixtral (MixtralForCausalLM). Their attention is Qwen3's and Llama's (Mistral's); their
MLPs are sparse mixtures of experts (layers/moe.py): Qwen3-MoE on the layers its
decoder_sparse_step and mlp_only_layers make sparse (its other layers are dense), Mixtral on
all. Expert weights load from the checkpoint's per-expert tensors. LoRA adapters and
fine-tuning are refused at start (engine_actors/model_checks.py).
"""
from __future__ import annotations

import re

import torch

from engine_actors.layers.moe import SparseMoE
from engine_actors.model_checks import layer_window
from engine_actors.models.llama import AttentionOptions, LlamaDecoderLayer, LlamaForCausalLM
from engine_actors.models.qwen import Qwen3ForCausalLM

# model.layers.<i>.<mlp | block_sparse_moe>.<gate | experts.<e>.<projection>>.weight, or
# model.layers.<i>.mlp.experts.<gate_up_proj | down_proj> (all experts stacked)
EXPERT_WEIGHT = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
                           r"(?:(gate)\.weight|experts\.(\d+)\.(\w+)\.weight|"
                           r"experts\.(gate_up_proj|down_proj))")


class MoEWeights:
    """Loading of the router's and experts' tensors (a mixin of the models below)."""

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | list[str] | None:
        m = EXPERT_WEIGHT.fullmatch(name)
        if m is None:
            return super().load_weight(name, tensor)
        layer = self.layers[m[1]] if m[1] in self.layers else None
        if layer is None or not isinstance(layer.mlp, SparseMoE):
            return None  # another stage's layer
        name = m[2] or m[5] or f"{m[3]}.{m[4]}"
        return [f"layers.{m[1]}.mlp.{key}" for key in layer.mlp.load_checkpoint(name, tensor)]


class Qwen3MoeForCausalLM(MoEWeights, Qwen3ForCausalLM):
    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        sparse = cfg.num_experts > 0 and i not in (cfg.mlp_only_layers or []) \
            and (i + 1) % cfg.decoder_sparse_step == 0
        mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                        cfg.num_experts_per_tok, cfg.norm_topk_prob, True, parallel) \
            if sparse else None
        return LlamaDecoderLayer(cfg, self.rotary, parallel, opts,
                                 layer_window(cfg, i, max_positions), mlp)


class MixtralForCausalLM(MoEWeights, LlamaForCausalLM):
    def new_layer(self, cfg, i: int, parallel, opts: AttentionOptions, max_positions: int):
        mlp = SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                        cfg.num_experts_per_tok, True, False, parallel)
        return LlamaDecoderLayer(cfg, self.rotary, parallel, opts,
                                 layer_window(cfg, i, max_positions), mlp)
