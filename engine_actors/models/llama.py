"""Llama for flattened batches (ORCA selective batching).

Every op except attention sees all tokens of the iteration as one [T, H] tensor, prefill
and decode requests mixed, no padding; attention splits per request inside the kernel.
Reads like the architecture: embed -> layers (norm, qkv, rope, attention, out, norm, mlp)
-> norm -> head. Only the tokens that sample go through the head.
"""
from __future__ import annotations

import torch
from torch import nn

from engine_actors.layers.attention import Attention, AttentionMetadata
from engine_actors.layers.embedding import Embedding, LMHead
from engine_actors.layers.linear import Linear, MergedLinear
from engine_actors.layers.norm import RMSNorm
from engine_actors.layers.rotary import RotaryEmbedding
from kernels.silu_mul import silu_mul


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(cfg, "attention_bias", False)
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias)
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.part_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, Hq, D]
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter, inter], bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        # The residual add of the previous sublayer is fused into the next norm.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (merged module name, part index)
    merged_parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> logits [N, V] for the N tokens in logits_indices."""
        hidden, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden[logits_indices]).float()  # [N, V]

    def weight_keys(self) -> set[str]:
        """Every (module.param, part) that a complete checkpoint fills."""
        keys = set()
        for path, module in self.named_modules():
            tied = path == "lm_head" and self.config.tie_word_embeddings
            if tied or not hasattr(module, "load"):
                continue
            parts = range(len(module.part_sizes)) if isinstance(module, MergedLinear) else [None]
            for param, _ in module.named_parameters(recurse=False):
                keys.update(f"{path}.{param}[{p}]" for p in parts)
        return keys

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load one checkpoint tensor (Hugging Face names); returns the key it filled, if any."""
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb" in name:
            return None
        module_path, _, param = name.rpartition(".")
        shard = None
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.merged_parts:
            merged, shard = self.merged_parts[leaf]
            module_path = f"{parent}.{merged}"
        if module_path == "lm_head" and self.config.tie_word_embeddings:
            return None
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None
        module.load(param, tensor, shard)
        return f"{module_path}.{param}[{shard}]"
