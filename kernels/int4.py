"""INT4 weights (W4A16): y = x @ w.T with w stored as 4-bit integers, 8 to an int32.

compressed-tensors' pack-quantized layout: element k of a row is bits 4 (k % 8) .. +3 of
word k // 8, as an unsigned nibble offset by 8 (q = nibble - 8, in [-8, 7]); each row has a
scale per group of `group` columns, w ~ q * scale (symmetric). Weights with zero points
(AWQ's, asymmetric GPTQ's) run the same kernels, and `add_zero_points` adds what the zero
points change.

On the GPU a weight is stored tiled (`tile`, once, as it loads): each block of TILE_N rows
is transposed to [words, TILE_N], so that a [BLOCK_K, TILE_N] tile of the kernel is one
contiguous read. Then
- up to KERNEL_MAX_TOKENS tokens (decode steps): `int4_matmul`'s kernel streams the packed
  tiles, unpacks and scales each in registers and multiplies it in x's dtype; the K range is
  split over up to 8 programs (their fp32 partial sums added by a second kernel) so that a
  projection with few column tiles still fills the GPU;
- more tokens (prompts): the weight is unpacked to x's dtype (`dequantize_tiled`) and
  multiplied by cuBLAS, which is faster there than unpacking each tile once per row block.
BENCHMARKS.md (2026-11-29, sixth part) has the measurements behind these choices.
On CPU the plain (untiled) weight is dequantized for each matmul, a reference path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.split_k import add_splits, plan

PACK = 8  # 4-bit values per int32
TILE_N = 128  # rows per stored tile
KERNEL_MAX_TOKENS = 128
# largest M -> (BLOCK_M, BLOCK_K, num_warps, num_stages); BLOCK_K at most the group
CONFIGS = ((16, (16, 128, 4, 3)), (64, (64, 128, 4, 3)), (None, (128, 64, 4, 3)))


@triton.jit
def _int4_kernel(x_ptr, w_ptr, s_ptr, c_ptr, bias_ptr, M, N, K, words, stride_x, stride_s,
                 k_per_split, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, BLOCK_K // 8)  # the tile's words along K
    mask_m, mask_n = rm < M, rn < N
    shifts = tl.arange(0, 8) * 4
    tile = w_ptr + tl.program_id(1) * words * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        offs_k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_x + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        offs_w = k0 // 8 + rw
        packed = tl.load(tile + offs_w[:, None] * BLOCK_N, mask=(offs_w < words)[:, None],
                         other=0)
        # [BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]: row 8 w + j is word w's nibble j
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N)) - 8
        s = tl.load(s_ptr + rn * stride_s + k0 // GROUP, mask=mask_n, other=0.0)
        w = (q.to(tl.float32) * s[None, :]).to(x.dtype)
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
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, words, stride_s, GROUP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_K, BLOCK_N] tile (within one group) unpacked, scaled and stored as rows
    of out [N, K]."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(w_ptr + tl.program_id(0) * words * BLOCK_N + rw[:, None] * BLOCK_N
                     + tl.arange(0, BLOCK_N)[None, :], mask=(rw < words)[:, None], other=0)
    q = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    q = tl.reshape(q, (BLOCK_K, BLOCK_N)) - 8
    s = tl.load(s_ptr + rn * stride_s + k0 // GROUP, mask=rn < N, other=0.0)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rn[None, :] * K + rk[:, None],
             (q.to(tl.float32) * s[None, :]).to(out_ptr.dtype.element_ty),
             mask=(rn < N)[None, :] & (rk < K)[:, None])


def tile(w: torch.Tensor) -> torch.Tensor:
    """Plain packed w [N, words] as [ceil(N / TILE_N), words, TILE_N] (rows past N: zeros)."""
    n, words = w.shape
    padded = torch.zeros(triton.cdiv(n, TILE_N) * TILE_N, words, dtype=w.dtype, device=w.device)
    padded[:n] = w
    return padded.view(-1, TILE_N, words).transpose(1, 2).contiguous()


def block_k(group: int, k: int) -> int:
    """The K tile: 128 columns, or the group when narrower (a tile within one group)."""
    if group >= k:
        return 128
    assert group % 16 == 0 and group & (group - 1) == 0, "groups: a power of two >= 16"
    return min(128, group)


def int4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None, split_k: int | None = None
                ) -> torch.Tensor:
    """x [M, K] @ dequantized(w).T (+ bias) in the kernel: w tiled ([ceil(N / TILE_N),
    ceil(K / 8), TILE_N] int32), scales [N, ceil(K / group)] fp32 (group >= K: one per row).
    split_k: programs along K (default: split_k.plan's)."""
    m, k = x.shape
    n = scales.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return out
    block_m, bk, warps, stages = config or next(
        c for limit, c in CONFIGS if limit is None or m <= limit)
    bk = min(bk, block_k(group, k))
    split_k, k_per_split, part = plan(x, triton.cdiv(m, block_m) * w.shape[0], k, bk, out,
                                      split_k)
    _int4_kernel[(triton.cdiv(m, block_m), w.shape[0], split_k)](
        x, w, scales, part, bias if bias is not None else out, m, n, k, w.shape[1],
        x.stride(0), scales.stride(0), k_per_split, GROUP=min(group, k),
        HAS_BIAS=bias is not None, SPLIT=split_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m,
        BLOCK_N=TILE_N, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if split_k > 1:
        add_splits(part, out, bias)
    return out


def dequantize_tiled(w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, k] of tiled w times its scales, in dtype (one kernel)."""
    n = scales.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    bk = block_k(group, k)
    _dequantize_kernel[(w.shape[0], triton.cdiv(k, bk))](
        w, scales, out, n, k, w.shape[1], scales.stride(0), GROUP=min(group, k),
        BLOCK_N=TILE_N, BLOCK_K=bk, num_warps=8)
    return out


def dequantize(w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, k] of plain packed w times its scales, in dtype."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    q = ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(w.shape[0], -1)[:, :k] - 8
    full = scales.repeat_interleave(group, 1)[:, :k] if group < k else scales.reshape(-1, 1)
    return (q.to(torch.float32) * full).to(dtype)


def add_zero_points(y: torch.Tensor, x: torch.Tensor, term: torch.Tensor, group: int,
                    k: int) -> torch.Tensor:
    """y += what zero points add to x @ w.T: w = (u - z) s = (u - 8) s + (8 - z) s, so each
    group's sum of x times term = (8 - z) s [N, groups] (fp32; group >= k: one group)."""
    group = min(group, k)
    groups = term.shape[1]
    sums = torch.nn.functional.pad(x.float(), (0, groups * group - k))
    sums = sums.view(*x.shape[:-1], groups, group).sum(-1)
    return y.add_((sums @ term.t()).to(y.dtype))


def int4_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group: int, k: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [..., k] @ w.T (+ bias; into `out` if given) for an INT4 weight: tiled on the
    GPU, plain on CPU."""
    if not x.is_cuda:
        y = torch.nn.functional.linear(x, dequantize(w, scales, group, k, x.dtype), bias)
        return y if out is None else out.copy_(y)
    flat = x.reshape(-1, k)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    n = scales.shape[0]
    out = None if out is None else out.view(-1, n)
    if flat.shape[0] <= KERNEL_MAX_TOKENS:
        y = int4_matmul(flat, w, scales, group, bias, out)
    else:
        weight = dequantize_tiled(w, scales, group, k, x.dtype)
        y = torch.addmm(bias, flat, weight.t(), out=out) if bias is not None else \
            torch.mm(flat, weight.t(), out=out)
    return y.view(*x.shape[:-1], n)
