"""INT4 weights (W4A16): y = x @ w.T with w stored as 4-bit integers, 8 to an int32.

compressed-tensors' pack-quantized layout: element k of a row is bits 4 (k % 8) .. +3 of
word k // 8, as an unsigned nibble offset by 8 (q = nibble - 8, in [-8, 7]); each row has a
scale per group of `group` columns, w ~ q * scale (symmetric). On the GPU, `int4_matmul`
streams the packed words, unpacks and scales each [BLOCK_K, BLOCK_N] tile in registers and
multiplies it in x's dtype: a decode step reads a quarter of bf16's bytes. On CPU the
weight is dequantized for each matmul, a reference path for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PACK = 8  # 4-bit values per int32
# largest M -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K at most the group
CONFIGS = ((16, (16, 64, 128, 4, 4)), (64, (64, 64, 128, 4, 3)), (None, (128, 128, 64, 8, 3)))


@triton.jit
def _int4_kernel(x_ptr, w_ptr, s_ptr, c_ptr, bias_ptr, M, N, K, words, stride_x, stride_s,
                 GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)  # the tile's words along K
    mask_m, mask_n = rm < M, rn < N
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        offs_w = k0 // 8 + rw
        packed = tl.load(w_ptr + rn[None, :] * words + offs_w[:, None],
                         mask=(offs_w < words)[:, None] & mask_n[None, :], other=0)
        # [BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]: row 8 w + j is word w's nibble j
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)) - 8
        s = tl.load(s_ptr + rn * stride_s + k0 // GROUP, mask=mask_n, other=0.0)
        w = (q.to(tl.float32) * s[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def int4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T (+ bias): w [N, ceil(K / 8)] int32, scales
    [N, ceil(K / group)] fp32 (group >= K: one per row)."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return out
    block_m, block_n, block_k, warps, stages = config or next(
        c for limit, c in CONFIGS if limit is None or m <= limit)
    if group < k:  # a K tile within one group
        assert group % 16 == 0 and group & (group - 1) == 0, "groups: a power of two >= 16"
        block_k = min(block_k, group)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_kernel[grid](x, w, scales, out, bias if bias is not None else out, m, n, k,
                       w.shape[1], x.stride(0), scales.stride(0), GROUP=min(group, k),
                       HAS_BIAS=bias is not None,
                       PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                       num_stages=stages)
    return out


def dequantize(w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, k] of packed w times its scales, in dtype."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    q = ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(w.shape[0], -1)[:, :k] - 8
    full = scales.repeat_interleave(group, 1)[:, :k] if group < k else scales.reshape(-1, 1)
    return (q.to(torch.float32) * full).to(dtype)


def int4_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [..., k] @ w.T (+ bias; into `out` if given) for a packed INT4 weight."""
    if not x.is_cuda:
        y = torch.nn.functional.linear(x, dequantize(w, scales, group, k, x.dtype), bias)
        return y if out is None else out.copy_(y)
    flat = x.reshape(-1, k)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    n = w.shape[0]
    y = int4_matmul(flat, w, scales, group, bias, None if out is None else out.view(-1, n))
    return y.view(*x.shape[:-1], n)
