"""INT4 weights (W4A16): y = x @ w.T with w stored as 4-bit integers, 8 to an int32
(kernels/int4_layout.py: the packing, and how the weights are stored on the GPU). INT8
weights (W8A16, 4 to an int32) take the same paths, with `bits` 8.

On the GPU
- up to KERNEL_MAX_TOKENS tokens (decode steps): `int4_matmul`'s kernel streams the packed
  tiles, unpacks and scales each in registers and multiplies it in x's dtype; the K range is
  split over up to 8 programs (their fp32 partial sums added by a second kernel) so that a
  projection with few column tiles still fills the GPU;
- more tokens (prompts): the weight is unpacked to x's dtype (`dequantize_tiled`) and
  multiplied by cuBLAS, which is faster there than unpacking each tile once per row block.
BENCHMARKS.md (2026-11-29, sixth and seventh parts) has the measurements behind these
choices. On CPU the plain (untiled) weight is dequantized for each matmul, a reference path.

Act-order weights are stored with each part's columns sorted by group (int4_layout.py's
ColumnOrder). x is then gathered once into each part's column order ([M, parts, K]): the
kernel reads each tile's part's copy (a part's rows start on a tile), and the prompt path
multiplies each part's copy by its rows of the unpacked weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.int4_layout import TILE_N, ColumnOrder, group_strides, unpack
from kernels.split_k import add_splits, plan

KERNEL_MAX_TOKENS = 128
# largest M -> (BLOCK_M, BLOCK_K, num_warps, num_stages); BLOCK_K at most the group
CONFIGS = ((16, (16, 128, 4, 3)), (64, (64, 128, 4, 3)), (None, (128, 64, 4, 3)))


@triton.jit
def unpack_tile(packed, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Words [BLOCK_K / P, BLOCK_N] (P = 32 / BITS values a word) as their unsigned values
    [BLOCK_K, BLOCK_N]: row P w + j is word w's value j."""
    q = (packed[:, None, :] >> (tl.arange(0, 32 // BITS) * BITS)[None, :, None]) \
        & ((1 << BITS) - 1)
    return tl.reshape(q, (BLOCK_K, BLOCK_N))


@triton.jit
def _int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, part_ptr, M, N, K, words,
                 stride_x, stride_part, stride_s, stride_sg, k_per_split, GROUP: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_ZERO: tl.constexpr, SPLIT: tl.constexpr,
                 ORDERED: tl.constexpr, PRECISION: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // (32 // BITS))  # the tile's words along K
    mask_m, mask_n = rm < M, rn < N
    tile = w_ptr + tl.program_id(1) * words * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if ORDERED:  # x in this tile's part's column order
        x_ptr += tl.load(part_ptr + tl.program_id(1)).to(tl.int64) * stride_part
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        offs_k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        offs_w = k0 // (32 // BITS) + rw
        packed = tl.load(tile + offs_w[:, None] * BLOCK_N, mask=(offs_w < words)[:, None],
                         other=0)
        q = unpack_tile(packed, BITS, BLOCK_K, BLOCK_N)
        at_group = rn * stride_s + (k0 // GROUP) * stride_sg
        s = tl.load(s_ptr + at_group, mask=mask_n, other=0.0)
        if HAS_ZERO:
            z = tl.load(z_ptr + at_group, mask=mask_n, other=0.0)
            w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x.dtype)
        else:
            w = ((q - (1 << (BITS - 1))).to(tl.float32) * s[None, :]).to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT > 1:  # this program's partial sums, added up by split_k.add_splits
        tl.store(c_ptr + tl.program_id(2) * M * N + rm[:, None] * N + rn[None, :], acc,
                 mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, words, stride_s, stride_sg,
                       GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BITS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_K, BLOCK_N] tile (within one group) unpacked, scaled and stored as rows
    of out [N, K]."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rw = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
    packed = tl.load(w_ptr + tl.program_id(0) * words * BLOCK_N + rw[:, None] * BLOCK_N
                     + tl.arange(0, BLOCK_N)[None, :], mask=(rw < words)[:, None], other=0)
    q = unpack_tile(packed, BITS, BLOCK_K, BLOCK_N).to(tl.float32)
    at_group = rn * stride_s + (k0 // GROUP) * stride_sg
    s = tl.load(s_ptr + at_group, mask=rn < N, other=0.0)
    if HAS_ZERO:
        q -= tl.load(z_ptr + at_group, mask=rn < N, other=0.0)[None, :]
    else:
        q -= 1 << (BITS - 1)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[None, :] * K + rk[:, None],
             (q * s[None, :]).to(out_ptr.dtype.element_ty),
             mask=(rn < N)[None, :] & (rk < K)[:, None])


def block_k(group: int, k: int) -> int:
    """The K tile: 128 columns, or the group when narrower (a tile within one group)."""
    if group >= k:
        return 128
    assert group % 16 == 0 and group & (group - 1) == 0, "groups: a power of two >= 16"
    return min(128, group)


def int4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None, split_k: int | None = None,
                order: ColumnOrder | None = None, zeros: torch.Tensor | None = None,
                bits: int = 4) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T (+ bias) in the kernel: w tiled ([ceil(N / TILE_N),
    ceil(K / P), TILE_N] int32, P = 32 / bits), scales [N, ceil(K / group)] fp32 (group >= K:
    one per row), zeros (zero points) None or as the scales.
    split_k: programs along K (default: split_k.plan's); order: an act-order weight's (x is
    gathered into each part's order first)."""
    m, k = x.shape
    n = scales.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return out
    xs = x if order is None else x[:, order.columns]  # ([M, parts, K])
    block_m, bk, warps, stages = config or next(
        c for limit, c in CONFIGS if limit is None or m <= limit)
    bk = min(bk, block_k(group, k))
    split_k, k_per_split, part = plan(x, triton.cdiv(m, block_m) * w.shape[0], k, bk, out,
                                      split_k)
    _int4_kernel[(triton.cdiv(m, block_m), w.shape[0], split_k)](
        xs, w, scales, scales if zeros is None else zeros, part,
        bias if bias is not None else out,
        w if order is None else order.tile_part, m, n, k, w.shape[1], xs.stride(0),
        xs.stride(1) if order else 0, *group_strides(scales, zeros), k_per_split,
        GROUP=min(group, k),
        HAS_BIAS=bias is not None, HAS_ZERO=zeros is not None, SPLIT=split_k,
        ORDERED=order is not None, BITS=bits,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m,
        BLOCK_N=TILE_N, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if split_k > 1:
        add_splits(part, out, bias)
    return out


def dequantize_tiled(w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
                     dtype: torch.dtype, zeros: torch.Tensor | None = None, bits: int = 4
                     ) -> torch.Tensor:
    """The weight [N, k] of tiled w (with zero points `zeros`, or 2^(bits - 1)) times its
    scales, in dtype (one kernel)."""
    n = scales.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    bk = block_k(group, k)
    _dequantize_kernel[(w.shape[0], triton.cdiv(k, bk))](
        w, scales, scales if zeros is None else zeros, out, n, k, w.shape[1],
        *group_strides(scales, zeros), GROUP=min(group, k), HAS_ZERO=zeros is not None,
        BITS=bits, BLOCK_N=TILE_N, BLOCK_K=bk, num_warps=8)
    return out


def dequantize(w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
               dtype: torch.dtype, zeros: torch.Tensor | None = None, bits: int = 4
               ) -> torch.Tensor:
    """The weight [N, k] of plain packed w (with zero points `zeros`, or 2^(bits - 1)) times
    its scales, in dtype (an act-order weight's columns in their stored order)."""
    def per_column(t):
        return t.repeat_interleave(group, 1)[:, :k] if group < k else t.reshape(-1, 1)
    q = unpack(w, k, bits).to(torch.float32) - \
        (1 << (bits - 1) if zeros is None else per_column(zeros))
    return (q * per_column(scales)).to(dtype)


def by_parts(x: torch.Tensor, weight: torch.Tensor, order: ColumnOrder,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight.T for a weight [N, K] in act-order's stored column order: x
    gathered into each part's order, times that part's rows."""
    xs = x[:, order.columns]  # [M, parts, K]
    y = torch.cat([xs[:, p] @ weight[start:end].t() for p, (start, end) in
                   enumerate(order.rows)], -1)
    return y if bias is None else y.add_(bias)


def int4_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                order: ColumnOrder | None = None, zeros: torch.Tensor | None = None,
                bits: int = 4) -> torch.Tensor:
    """x [..., k] @ w.T (+ bias; into `out` if given) for an INT4 (bits 4) or INT8 (8)
    weight: tiled on the GPU, plain on CPU; order: an act-order weight's; zeros: its zero
    points, if any."""
    if not x.is_cuda:
        weight = dequantize(w, scales, group, k, x.dtype, zeros=zeros, bits=bits)
        y = torch.nn.functional.linear(x, weight, bias) if order is None else \
            by_parts(x.reshape(-1, k), weight, order, bias).view(*x.shape[:-1], -1)
        return y if out is None else out.copy_(y)
    flat = x.reshape(-1, k)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    n = scales.shape[0]
    out = None if out is None else out.view(-1, n)
    if flat.shape[0] <= KERNEL_MAX_TOKENS:
        y = int4_matmul(flat, w, scales, group, bias, out, order=order, zeros=zeros,
                        bits=bits)
    elif order is not None:
        y = by_parts(flat, dequantize_tiled(w, scales, group, k, x.dtype, zeros, bits), order,
                     bias)
        y = y if out is None else out.copy_(y)
    else:
        weight = dequantize_tiled(w, scales, group, k, x.dtype, zeros, bits)
        y = torch.addmm(bias, flat, weight.t(), out=out) if bias is not None else \
            torch.mm(flat, weight.t(), out=out)
    return y.view(*x.shape[:-1], n)
