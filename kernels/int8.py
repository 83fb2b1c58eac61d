"""W8A8 INT8 matmuls: y = x @ w.T with w stored as int8 [N, K] and a scale per output row
(w ~ q * scale), and x quantized to int8 per token as it comes: each row's absolute maximum
maps to 127 (scale = amax / 127, q = x / scale rounded half to even), as vLLM's dynamic
per-token INT8. The int8 products are summed in int32 and scaled once: y = acc * sx * sw.

`int8_linear` on the GPU:
- up to WEIGHT_ONLY_MAX_TOKENS tokens (decode steps) in bf16 or fp16: kernels.fp8's
  weight-only kernel, which widens each int8 tile to x's dtype as it loads (its K range
  split over programs), as FP8's decode steps do; no launch to quantize x, and the weights'
  bytes are the same;
- more tokens (or fp32 activations): `quantize_rows` then `int8_matmul`, on int8 tensor
  cores (twice bf16's rate on Hopper).
So in bf16 a token's activations are quantized only in steps of more than 32 tokens (as
FP8's above 16): a decode token's numbers depend on its step's size, where with the
quantized path alone they would not (each row is quantized on its own and the int32 sums
are exact).
BENCHMARKS.md (2026-11-29, ninth part) has the measurements behind the tiles and the
threshold.
On CPU the same arithmetic by torch._int_mm, a reference path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import weight_only_matmul
from kernels.fp8_quantize import quantize_rows_kernel

INT8_MAX = 127.0
WEIGHT_ONLY_MAX_TOKENS = 32
# largest M -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = ((32, (16, 64, 256, 4, 4)), (128, (64, 64, 256, 4, 4)),
           (512, (64, 128, 128, 8, 4)), (None, (128, 128, 128, 8, 3)))
GROUP_M = 8  # row tiles per band of programs (the weight's tiles reused from L2)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] int8, scales [M] fp32), x ~ q * scale, one scale per token."""
    m, k = x.shape
    if not x.is_cuda:
        scales = x.float().abs().amax(1).clamp(min=1e-12) / INT8_MAX
        q = torch.round(x.float() / scales[:, None]).clamp(-128, 127).to(torch.int8)
        return q, scales
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), INT8=True, BLOCK=1024,
                                   num_warps=4)
    return q, scales


@triton.jit
def _int8_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, c_ptr, bias_ptr, M, N, K,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # programs in bands of GROUP_M row tiles, column tile by column tile
    pid, tiles_m, tiles_n = tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * tiles_n) * GROUP_M
    band = tl.minimum(tiles_m - first_m, GROUP_M)
    rm = (first_m + pid % band) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % (GROUP_M * tiles_n)) // band * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m, mask_n = rm < M, rn < N
    rows, cols = rm.to(tl.int64), rn.to(tl.int64)  # (offsets past 2^31 in large steps)
    a_ptrs = a_ptr + rows[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + cols[None, :] * K + rk[:, None]  # w [N, K] read as a [K, N] tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = rk < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = acc.to(tl.float32) * tl.load(a_s_ptr + rm, mask=mask_m, other=0.0)[:, None] \
        * tl.load(w_s_ptr + rn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], out.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def int8_matmul(q: torch.Tensor, q_scales: torch.Tensor, w: torch.Tensor,
                w_scales: torch.Tensor, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """q [M, K] int8 with q_scales [M] (quantize_rows) times w [N, K] int8 with w_scales [N],
    transposed: [M, N] in out_dtype (into `out` if given). config: a tile (default:
    CONFIGS' by M)."""
    m, k = q.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if not m:
        return out
    block_m, block_n, block_k, warps, stages = config or next(
        c for limit, c in CONFIGS if limit is None or m <= limit)
    _int8_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
        q, q_scales, w, w_scales, out, bias if bias is not None else out, m, n, k,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return out


def int8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias; into `out` if given) for an int8 weight w [N, K] with a
    scale per row: by one of the paths above."""
    flat = x.reshape(-1, x.shape[-1])
    n = w.shape[0]
    if not x.is_cuda:
        q, q_scales = quantize_rows(flat)
        acc = torch._int_mm(q, w.t()) if q.shape[0] else q.new_zeros(0, n, dtype=torch.int32)
        y = (acc.float() * q_scales[:, None] * scales[None, :]).to(x.dtype)
        y = (y if bias is None else y + bias).view(*x.shape[:-1], n)
        return y if out is None else out.copy_(y)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    out = None if out is None else out.view(-1, n)
    if flat.shape[0] <= WEIGHT_ONLY_MAX_TOKENS and x.dtype != torch.float32:
        y = weight_only_matmul(flat, w, scales, None, bias, out)
    else:
        q, q_scales = quantize_rows(flat)
        y = int8_matmul(q, q_scales, w, scales, x.dtype, bias, out)
    return y.view(*x.shape[:-1], n)
