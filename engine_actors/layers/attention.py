"""The attention layer of a flattened iteration: write new keys/values, attend per request."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import paged_attention
from kernels.kv_write import FP8_KV, kv_write


@dataclass(slots=True)
class AttentionMetadata:
    """Where each request's tokens are, for one iteration. Built once, shared by all layers."""
    cu_seqlens_q: torch.Tensor  # [B+1] int32, offsets of each request's new tokens in [T]
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens per request
    block_tables: torch.Tensor  # [B, M] int32, block ids per request
    slot_mapping: torch.Tensor  # [T] int64, KV pool slot of each new token
    block_size: int
    max_query_len: int  # sizes the attention launch; 1 for a decode-only step
    work: torch.Tensor | None = None  # under a mixed-step CUDA graph: kernels.attention.work_list
    splits: int | None = None  # the work list's chunks per decode row (None: 1)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, window: int = 0,
                 scale: float | None = None, softcap: float = 0.0):
        """window: a sliding window of this many positions (0: none); scale: of the scores
        (None: 1 / sqrt(head_dim)); softcap: their soft-capping (0: none; Gemma 2's)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        # an FP8 KV pool stores keys / k_scale and values / v_scale (kernels/kv_write.py):
        # 1.0, or the checkpoint's per-tensor scales (load_scale); other pools ignore them
        self.k_scale = self.v_scale = 1.0

    def load_scale(self, name: str, tensor: torch.Tensor) -> None:
        """A checkpoint's `k_scale` or `v_scale` (one value: the same on every rank)."""
        if tensor.numel() != 1 or not float(tensor) > 0:
            raise ValueError(f"a KV cache {name} must be one positive value, got "
                             f"{tensor.flatten()[:4].tolist()}")
        setattr(self, name, float(tensor))

    def forward(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        k_cache, v_cache = kv_cache  # [S, Hkv, D] each
        scales = (self.k_scale, self.v_scale) if k_cache.dtype in FP8_KV else (1.0, 1.0)
        kv_write(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        return paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                               meta.block_tables, meta.block_size, self.scale, meta.max_query_len,
                               meta.work, self.window, self.softcap, *scales, meta.splits)
