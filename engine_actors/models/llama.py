"""Llama for flattened batches (ORCA selective batching), as one pipeline stage.

Every op except attention sees all tokens of the iteration as one [T, H] tensor, prefill
and decode requests mixed, no padding; attention splits per request inside the kernel.
Reads like the architecture: embed -> layers (norm, qkv, rope, attention, out, norm, mlp)
-> norm -> head. A stage holds a contiguous range of layers: only the first embeds, only
the last has the final norm and the head, and only the tokens that sample reach the head.
Tensor parallelism lives in the layers (ParallelGroup); this file stays plain. Mistral is
this model (with its sliding window); Qwen2 and Qwen3 differ only in their attention
options (models/qwen.py); Gemma 2 and 3 in their layers, norms, rotary, embedding and
logits (models/gemma.py, through the hooks make_rotary, new_layer, embed and logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_actors.layers.attention import Attention, AttentionMetadata
from engine_actors.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine_actors.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine_actors.layers.norm import RMSNorm
from engine_actors.layers.rotary import RotaryEmbedding
from engine_actors.model_checks import layer_window
from engine_actors.parallel import SINGLE, ParallelGroup, stage_layers
from engine_actors.quantization import SCALE_NAMES, UNUSED, UNUSED_ATTENTION, kv_scale_name
from kernels.act_mul import act_mul


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """Where the attention of Llama-family architectures differs."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head before rotary (Qwen3)
    # those norms over all of a token's query (key) heads at once (OLMo 2 and 3)
    qk_norm_over_heads: bool = False
    unit_offset: bool = False  # those norms are Gemma's (weight as 1 + weight)
    scale: float | None = None  # of the attention scores (None: 1 / sqrt(head_dim))
    softcap: float = 0.0  # the scores' soft-capping (Gemma 2's; 0: none)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, parallel: ParallelGroup,
                 opts: AttentionOptions, window: int = 0):
        super().__init__()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [(heads, head_dim), (kv_heads, head_dim), (kv_heads, head_dim)],
            opts.qkv_bias, parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.local_heads[:2]  # on this rank
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, cfg.hidden_size, opts.o_bias, parallel)
        if opts.qk_norm:
            q_width, k_width = (self.num_heads * head_dim, self.num_kv_heads * head_dim) \
                if opts.qk_norm_over_heads else (head_dim, head_dim)
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, opts.unit_offset)
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, opts.unit_offset)
        self.qk_norm = opts.qk_norm
        self.rotary = rotary  # shared by all layers (None: no rotary in this layer, NoPE)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, window, opts.scale,
                              opts.softcap)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.part_sizes, dim=-1)
        if self.qk_norm:  # per head ([T * H, D] rows), or over all heads ([T, H * D])
            q = self.q_norm(q.reshape(-1, self.q_norm.weight.shape[0]))
            k = self.k_norm(k.reshape(-1, self.k_norm.weight.shape[0]))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, Hq, D]
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, parallel: ParallelGroup, inter: int | None = None):
        """inter: the intermediate size, if not the config's (Qwen2-MoE's shared expert)."""
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        inter = inter or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [(inter, 1), (inter, 1)],
                                                 bias, parallel)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, parallel)

    def forward(self, x):
        return self.down_proj(act_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, parallel: ParallelGroup,
                 opts: AttentionOptions, window: int = 0, mlp: nn.Module | None = None):
        """mlp: another MLP than Llama's (a mixture of experts)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, parallel, opts, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, parallel)

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
    unit_offset = False  # Gemma's norms (weight as 1 + weight)
    # checkpoint projection name -> (merged module name, part index)
    merged_parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @staticmethod
    def attention_options(cfg) -> AttentionOptions:
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def __init__(self, cfg, max_positions: int, parallel: ParallelGroup = SINGLE):
        super().__init__()
        opts = self.attention_options(cfg)
        self.config, self.parallel = cfg, parallel
        self.layer_ids = stage_layers(cfg.num_hidden_layers, parallel.pp_rank, parallel.pp_size)
        tied = cfg.tie_word_embeddings
        if parallel.is_first_stage or (tied and parallel.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.rotary = self.make_rotary(cfg, max_positions)
        self.layers = nn.ModuleDict({  # keyed by checkpoint index
            str(i): self.new_layer(cfg, i, parallel, opts, max_positions)
            for i in self.layer_ids})
        if parallel.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.unit_offset)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, cfg, max_positions: int) -> nn.Module:
        return RotaryEmbedding(cfg, max_positions)  # shared by all layers

    def new_layer(self, cfg, i: int, parallel: ParallelGroup, opts: AttentionOptions,
                  max_positions: int) -> nn.Module:
        """Layer i (its sliding window: the config's for that layer)."""
        return LlamaDecoderLayer(cfg, self.rotary, parallel, opts,
                                 layer_window(cfg, i, max_positions))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                logits_indices: torch.Tensor, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, head: bool = True):
        """First stage: input_ids [T]; later stages: hidden, residual [T, H] from the previous.
        Returns (hidden, residual) [T, H], or on the last stage fp32 logits [N, V] of the N
        tokens in logits_indices (head=False: their final hidden states [N, H])."""
        if self.parallel.is_first_stage:
            hidden, residual = self.embed(input_ids), None  # [T, H]
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.parallel.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return self.logits(hidden[logits_indices]) if head else hidden[logits_indices]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, H] -> fp32 logits [N, V]."""
        return self.lm_head(hidden).float()

    def weight_keys(self) -> set[str]:
        """Every (module.param, part) that a complete checkpoint fills on this stage/rank."""
        keys = set()
        for path, module in self.named_modules():
            if hasattr(module, "checkpoint_keys"):  # (a mixture of experts: load_weight
                keys.update(f"{path}.{key}" for key in module.checkpoint_keys())  # returns
                continue  # a list of these)
            tied = path == "lm_head" and self.config.tie_word_embeddings
            if tied or not hasattr(module, "load"):
                continue
            parts = range(len(module.parts)) if isinstance(module, ColumnParallelLinear) \
                else [None]
            for param, _ in module.named_parameters(recurse=False):
                if param != "weight_scale" or not module.quant.online:  # (made as it loads)
                    keys.update(f"{path}.{param}[{p}]" for p in parts)
        return keys

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Load this stage's and rank's share of one checkpoint tensor (Hugging Face names);
        returns the key it filled, or None if it is not for this worker."""
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb" in name or UNUSED_ATTENTION.fullmatch(name):
            return None
        if kv_scale := kv_scale_name(name):  # (optional: an FP8 KV pool defaults to 1.0)
            try:
                attn = self.get_submodule(kv_scale[0]).attn
            except AttributeError:
                return None  # another stage's layer
            for scale in kv_scale[1]:
                attn.load_scale(scale, tensor)
            return None
        module_path, _, param = name.rpartition(".")
        if param in UNUSED:
            return None
        param, shard = SCALE_NAMES.get(param, param), None
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.merged_parts:
            merged, shard = self.merged_parts[leaf]
            module_path = f"{parent}.{merged}"
        if module_path == "lm_head" and self.config.tie_word_embeddings:
            return None
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None  # another stage's layer, or a module this model does not have
        module.load(param, tensor, shard)
        return f"{module_path}.{param}[{shard}]"
