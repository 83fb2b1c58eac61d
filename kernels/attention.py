"""Attention over a flattened iteration, reading keys/values from the paged KV pool.

Interface (shared by the reference and the Triton kernel):
  q            [T, Hq, D]   queries of every new token of the iteration, requests concatenated
  k_cache      [S, Hkv, D]  the layer's key pool, S = num_blocks * block_size token slots
  v_cache      [S, Hkv, D]
  cu_seqlens_q [B+1]        request i owns q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]
  seq_lens     [B]          tokens of request i in the cache, the new ones included
  block_tables [B, M]       block ids of request i, in position order
A request's new tokens are the last ones of its sequence: query j of request i sits at
position seq_lens[i] - q_len_i + j and attends causally to positions 0..that position.
Prefill, chunked prefill and decode (q_len 1) are the same case. GQA: Hq % Hkv == 0.
"""
from __future__ import annotations

import torch


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                        block_size: int, scale: float) -> torch.Tensor:
    """Per-request attention in plain torch (ORCA's split -> attention -> merge).

    Takes cu_seqlens_q and seq_lens as host lists: it loops over requests.
    """
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens):
        start, end = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        q_len = end - start
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale  # [Hq, q_len, L]
        q_pos = pos[seq_len - q_len:, None]  # [q_len, 1]
        scores = scores.masked_fill(pos[None, :] > q_pos, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, block_size, scale):
    return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                               block_size, scale)
