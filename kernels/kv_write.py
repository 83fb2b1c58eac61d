"""Scatter the keys/values of an iteration's new tokens into their KV pool slots.

An FP8 pool (kv_cache_dtype "fp8"/"fp8_e4m3" or "fp8_e5m2") stores x / scale, clamped to
the format's range and rounded to nearest even; attention multiplies the scale back
(kernels/attention.py). One scale per layer for keys and one for values: 1.0, or the
checkpoint's (vLLM's per-tensor `k_scale` and `v_scale`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_KV = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the pool stores it: unchanged for a pool in the model's dtype, else quantized."""
    if dtype not in FP8_KV:
        return x
    limit = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [S, Hkv, D]; slot_mapping: [T] slot of each token."""
    k_cache[slot_mapping] = to_cache(k, k_cache.dtype, k_scale)
    v_cache[slot_mapping] = to_cache(v, v_cache.dtype, v_scale)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
                     stride_ct, k_inv, v_inv, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     LIMIT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW  # one token's Hkv * D values, contiguous in both layouts
    k = tl.load(k_ptr + t * stride_kt + offs, mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask)
    if LIMIT > 0:  # an FP8 pool
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv, -LIMIT), LIMIT)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv, -LIMIT), LIMIT)
    tl.store(k_cache_ptr + slot * stride_ct + offs, k.to(k_cache_ptr.dtype.element_ty), mask)
    tl.store(v_cache_ptr + slot * stride_ct + offs, v.to(v_cache_ptr.dtype.element_ty), mask)


def kv_write_triton(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    num_tokens, num_heads, head_dim = k.shape
    assert k.stride(1) == head_dim and v.stride(1) == head_dim and k.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.dtype == k_cache.dtype or k_cache.dtype in FP8_KV
    row = num_heads * head_dim
    limit = torch.finfo(k_cache.dtype).max if k_cache.dtype in FP8_KV else 0.0
    _kv_write_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), k_cache.stride(0), 1.0 / k_scale, 1.0 / v_scale,
                                    ROW=row, BLOCK=triton.next_power_of_2(row), LIMIT=limit)


def kv_write(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    fn = kv_write_triton if k.is_cuda else kv_write_ref
    fn(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
