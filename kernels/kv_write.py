"""Scatter the keys/values of an iteration's new tokens into their KV pool slots."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [S, Hkv, D]; slot_mapping: [T] slot of each token."""
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
                     stride_ct, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW  # one token's Hkv * D values, contiguous in both layouts
    tl.store(k_cache_ptr + slot * stride_ct + offs, tl.load(k_ptr + t * stride_kt + offs, mask),
             mask)
    tl.store(v_cache_ptr + slot * stride_ct + offs, tl.load(v_ptr + t * stride_vt + offs, mask),
             mask)


def kv_write_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = k.shape
    assert k.stride(1) == head_dim and v.stride(1) == head_dim and k.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k.dtype == k_cache.dtype
    row = num_heads * head_dim
    _kv_write_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), k_cache.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row))


def kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    fn = kv_write_triton if k.is_cuda else kv_write_ref
    fn(k, v, k_cache, v_cache, slot_mapping)
