"""FP8 (e4m3) matmuls: y = x @ w.T with w stored as float8 and its scales.

Weight scales are either [N] (per output channel) or [ceil(N / bn), ceil(K / bk)] (per
bn x bk block, as transformers' fine-grained FP8 checkpoints store them). `fp8_linear`
picks one of three paths on the GPU:
- per-channel scales, up to WEIGHT_ONLY_MAX_TOKENS tokens (small decode steps), or
  activations other than bf16: `weight_only_matmul`, where x stays in its dtype and each
  e4m3 weight tile is widened (times its scales) as it loads, the K range split over
  programs (split_k.py);
- per-channel scales, more tokens, on Hopper: the activations quantized per token
  (`quantize_rows`) and cuBLASLt's FP8 matmul (torch._scaled_mm);
- 128 x 128 blocks, more than TRITON_BLOCKS_MAX_TOKENS tokens, on Hopper: the activations
  quantized per token and 128 columns (`quantize_groups`) and cuBLASLt's blockwise-scaled
  FP8 matmul (F.scaled_mm, torch 2.9+);
- the rest (other blocks, fewer tokens, other GPUs, torch without it): `fp8_matmul`, this
  file's W8A8 kernel: each group's partial product scaled by its rows' activation scales
  and, for blocks, by its weight block's scale as it is added.
BENCHMARKS.md (2026-11-28) has the measurements behind the thresholds; none of the small-M
paths reaches the e4m3 weights' bandwidth floor.
The activations' quantization (per token, or per token and group of columns) is
kernels/fp8_quantize.py's.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8_quantize import GROUP, quantize_groups, quantize_rows
from kernels.split_k import add_splits, plan

try:  # (torch 2.9+)
    from torch.nn.functional import ScalingType
except ImportError:
    ScalingType = None


# fp8_matmul's tiles: largest M -> (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_K is the
# group width
CONFIGS = ((16, (16, 64, 4, 4)), (64, (64, 64, 4, 4)), (256, (64, 128, 4, 4)),
           (None, (128, 128, 8, 3)))


# tokens up to which the activations stay unquantized (weight_only_matmul), and its tile
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
WEIGHT_ONLY_MAX_TOKENS = 16
SMALL_CONFIGS = ((16, (16, 32, 256, 4, 4)), (None, (32, 64, 256, 4, 3)))
# tokens up to which block-scaled weights take fp8_matmul rather than cuBLASLt
TRITON_BLOCKS_MAX_TOKENS = 64


def config(m: int) -> tuple[int, int, int, int]:
    return next(c for limit, c in CONFIGS if limit is None or m <= limit)


@triton.jit
def _epilogue(acc, c_ptr, scale_ptr, bias_ptr, rm, rn, M, N, ROW_SCALES: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """Both matmul kernels' end: per-channel weight scales and the bias applied to the fp32
    tile, stored in c's dtype."""
    mask_m, mask_n = rm < M, rn < N
    if ROW_SCALES:
        acc = acc * tl.load(scale_ptr + rn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _matmul_kernel(a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, bias_ptr, M, N, K, num_groups,
                   stride_asm, stride_asg, stride_bs, SCALE_ROWS: tl.constexpr, PER_BLOCK: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m, mask_n = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rn[None, :] * K + rk[:, None]  # w [N, K] read as a [K, N] tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(num_groups):
        mask_k = rk < K - g * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_s = tl.load(a_s_ptr + rm * stride_asm + g * stride_asg, mask=mask_m, other=0.0)
        part = tl.dot(a, b) * a_s[:, None]
        if PER_BLOCK:
            b_s = tl.load(b_s_ptr + (rn // SCALE_ROWS) * stride_bs + g, mask=mask_n, other=0.0)
            part = part * b_s[None, :]
        acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _epilogue(acc, c_ptr, b_s_ptr, bias_ptr, rm, rn, M, N, not PER_BLOCK, HAS_BIAS)


def fp8_matmul(q: torch.Tensor, q_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
               block_n: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
               group: int = GROUP, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, K] e4m3 with q_scales [M, ceil(K / group)] (quantize_groups) times w [N, K]
    e4m3 transposed: [M, N] in out_dtype (into `out` if given). w_scales [N] (block_n None)
    or [ceil(N / block_n), ceil(K / group)]."""
    m, k = q.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if not m:
        return out
    block_m, block_n_tile, warps, stages = config(m)  # (each column reads its block's scale)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n_tile))
    _matmul_kernel[grid](q, q_scales, w, w_scales, out, bias if bias is not None else out,
                         m, n, k, triton.cdiv(k, group), *q_scales.stride(), w_scales.stride(0),
                         SCALE_ROWS=block_n or 1, PER_BLOCK=block_n is not None,
                         HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n_tile,
                         BLOCK_K=group, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, s_ptr, c_ptr, bias_ptr, M, N, K, stride_x, stride_s,
                        k_per_split, SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr,
                        PER_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    rk = k_begin + tl.arange(0, BLOCK_K)
    mask_m, mask_n = rm < M, rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_x + rk[None, :]
    w_ptrs = w_ptr + rn[None, :] * K + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale_row = s_ptr + (tl.program_id(1) * BLOCK_N // SCALE_ROWS) * stride_s  # (one per tile)
    for k0 in range(0, tl.minimum(k_per_split, K - k_begin), BLOCK_K):
        mask_k = rk < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if PER_BLOCK:  # each row of the tile times its column block's scale
            s = tl.load(scale_row + (k0 + rk) // GROUP, mask=mask_k, other=0.0)
            w = w.to(tl.float32) * s[:, None]
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT > 1:  # this program's partial sums (row scales applied), for split_k.add_splits
        if not PER_BLOCK:
            acc = acc * tl.load(s_ptr + rn, mask=mask_n, other=0.0)[None, :]
        tl.store(c_ptr + tl.program_id(2) * M * N + rm[:, None] * N + rn[None, :], acc,
                 mask=mask_m[:, None] & mask_n[None, :])
    else:
        _epilogue(acc, c_ptr, s_ptr, bias_ptr, rm, rn, M, N, not PER_BLOCK, HAS_BIAS)


def weight_only_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
                       block: tuple[int, int] | None, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, split_k: int | None = None
                       ) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T with x unquantized: each e4m3 tile is widened to x's dtype
    (times its blocks' scales) as it loads. A decode step's few rows only stream the weights,
    so this is bound by their bytes (half of bf16's), with no launch to quantize x. The K
    range is split over programs as split_k.plan says (split_k: that many)."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return out
    block_m, block_n, block_k, warps, stages = next(
        c for limit, c in SMALL_CONFIGS if limit is None or m <= limit)
    while block is not None and block[0] % block_n:  # a tile within one row of blocks
        block_n //= 2
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    split, k_per_split, part = plan(x, grid[0] * grid[1], k, block_k, out, split_k)
    _weight_only_kernel[(*grid, split)](
        x, w, scales, part, bias if bias is not None else out, m, n, k, x.stride(0),
        scales.stride(0), k_per_split, SCALE_ROWS=block[0] if block else 1,
        GROUP=block[1] if block else k, PER_BLOCK=block is not None, HAS_BIAS=bias is not None,
        SPLIT=split, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    if split > 1:
        add_splits(part, out, bias)
    return out


def dequantize(w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight w [..., N, K] e4m3 (a mixture's experts: [E, N, K]) times its scales, in
    dtype (block: (rows, columns) of a scale's block; None: one scale per row)."""
    n, k = w.shape[-2:]
    if block is None:
        full = scales.reshape(*w.shape[:-1], 1)
    else:
        full = scales.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(
            block[1], -1)[..., :k]
    return (w.to(torch.float32) * full).to(dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias; into `out` if given) for an e4m3 weight: on the GPU by one
    of the paths above; elsewhere the weight is dequantized and multiplied in x's dtype."""
    if not x.is_cuda:
        y = torch.nn.functional.linear(x, dequantize(w, scales, block, x.dtype), bias)
        return y if out is None else out.copy_(y)
    flat = x.reshape(-1, x.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    m, (n, k) = flat.shape[0], w.shape
    out = None if out is None else out.view(-1, n)
    cublas = x.dtype == torch.bfloat16 and _hopper(x.device.index)
    if block is None and (m <= WEIGHT_ONLY_MAX_TOKENS or x.dtype != torch.bfloat16):
        return weight_only_matmul(flat, w, scales, block, bias, out).view(*x.shape[:-1], n)
    if block is None and not (cublas and n % 16 == 0 and k % 16 == 0):
        q, q_scales = quantize_groups(flat, GROUP)  # (per-channel weight scales)
        y = fp8_matmul(q, q_scales, w, scales, None, x.dtype, bias, GROUP, out)
        return y.view(*x.shape[:-1], n)
    if block is None:  # per-token activations on cuBLASLt's FP8 matmul (bf16 out)
        q, q_scales = quantize_rows(flat)
        y = torch._scaled_mm(q, w.t(), scale_a=q_scales, scale_b=scales[None, :],
                             out_dtype=x.dtype)
    elif cublas and m > TRITON_BLOCKS_MAX_TOKENS and _cublas_blocks(block, n, k):
        # 1 x 128 activation blocks, 128 x 128 weight blocks
        q, q_scales = quantize_groups(flat, block[1], columns_first=True)
        y = F.scaled_mm(q, w.t(), scale_a=q_scales, scale_recipe_a=ScalingType.BlockWise1x128,
                        scale_b=scales.t(), scale_recipe_b=ScalingType.BlockWise128x128,
                        output_dtype=x.dtype)
    else:
        q, q_scales = quantize_groups(flat, block[1])
        y = fp8_matmul(q, q_scales, w, scales, block[0], x.dtype, bias, block[1], out)
        return y.view(*x.shape[:-1], n)
    y = y if bias is None else y.add_(bias)
    return (y if out is None else out.copy_(y)).view(*x.shape[:-1], n)


@functools.cache
def _hopper(device: int | None) -> bool:
    """cuBLASLt's FP8 paths were measured and tested on H100 and H200 only."""
    return torch.cuda.get_device_capability(device)[0] == 9


def _cublas_blocks(block: tuple[int, int], n: int, k: int) -> bool:
    """cuBLASLt's blockwise-scaled FP8 matmul (torch 2.9+ with CUDA 12.9+, on Hopper) takes
    128 x 128 weight blocks of whole tiles, their scales in columns of a multiple of 4."""
    return ScalingType is not None and block == (128, 128) and n % 128 == 0 \
        and k % 512 == 0
