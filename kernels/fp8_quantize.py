"""Activations quantized to FP8 (e4m3) for the W8A8 matmuls of kernels/fp8.py and
kernels/moe.py: per token and group of columns (`quantize_groups`), or per token
(`quantize_rows`). A scale is its group's absolute maximum over 448, e4m3's largest value.
The per-token kernel also quantizes to int8 for kernels/int8.py (INT8: over 127, rounded
half to even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # activation columns per scale with per-channel weight scales


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, num_groups, stride_x, stride_sm, stride_sg,
                     GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups[:, None] < num_groups) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), 448.0)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)  # (IEEE division, as torch)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def quantize_groups(x: torch.Tensor, group: int = GROUP, columns_first: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scales [M, ceil(K / group)] fp32), x ~ q * scale;
    columns_first: the scales stored group by group (the layout cuBLASLt takes)."""
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(num_groups, m, dtype=torch.float32, device=x.device).t() \
        if columns_first else torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    per_program = max(1, 1024 // group)
    if m:
        _quantize_kernel[(m, triton.cdiv(num_groups, per_program))](
            x, q, scales, m, k, num_groups, x.stride(0), *scales.stride(), GROUP=group,
            GROUPS_PER_PROGRAM=per_program)
    return q, scales


@triton.jit
def round_half_even(v):
    """v rounded to the nearest integer, halves to the even one (as torch.round)."""
    f = tl.floor(v)
    d = v - f
    return tl.where(d > 0.5, f + 1, tl.where(d < 0.5, f, f + (f - 2 * tl.floor(f * 0.5))))


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, INT8: tl.constexpr,
                         BLOCK: tl.constexpr):
    """One row of x: its scale (amax over 448, or over 127 for INT8) and its values over it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=cols < K - k0, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax), 1e-12), 127.0 if INT8 else 448.0)
    for k0 in range(0, K, BLOCK):
        mask = cols < K - k0
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        if INT8:
            q = tl.clamp(round_half_even(tl.math.div_rn(x, scale)), -128.0, 127.0)
        else:
            q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        tl.store(q_ptr + row * K + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scales [M, 1] fp32): one scale per token."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), INT8=False, BLOCK=1024,
                                   num_warps=4)
    return q, scales
