"""The experts' matmuls of a mixture of experts, fused over all experts in one launch.

A step's (token, expert) pairs are numbered p = token * top_k + j, as the router's [T, k]
picks flatten. `align_pairs` lists them expert by expert, each expert's run padded to a
whole number of BLOCK_M rows (padding: the index `num_pairs`, masked), and names the
expert of each block; all on the device, so a step stays capturable in a CUDA graph (the
grid is the most blocks any routing can need; blocks past the last are told so by expert
index E and return). `expert_matmul` then runs one program per (block, N tile): it gathers
its block's rows of `a` (a token's hidden state for the first matmul, a pair's own row for
the second), multiplies them by its expert's weight tile and writes each row back at its
pair's index, so the outputs come out in pair order with no permutation to undo. A decode
batch puts a few pairs on each expert: a block of 16 rows per expert, and each program
streams one expert's [BLOCK_N, K] weight tile once, which is what bounds the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quantize import GROUP, quantize_groups
from kernels.int4 import block_k as int4_block_k
from kernels.int4 import unpack_tile


# BLOCK_M -> (BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = {16: (64, 128, 4, 3), 64: (128, 64, 4, 3), 128: (256, 64, 8, 3)}
# with e4m3 activations (BLOCK_K: their scales' group)
FP8_CONFIGS = {16: (64, 0, 4, 3), 64: (128, 0, 4, 3), 128: (128, 0, 8, 3)}


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 (the smallest tl.dot M) while experts get few pairs (decode), 64
    then 128 as they get more (prompts)."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 8 else 64 if per_expert <= 64 else 128


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] (int) -> (pair_ids [B * block_m] int32: pair indices expert by
    expert, each expert's run padded to a multiple of block_m with T * k; block_experts [B]
    int32: each block's expert, num_experts past the last), B the most blocks possible.
    On the GPU one launch does it (instead of some twenty small ones); on CPU, torch ops."""
    num_pairs = experts.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    if experts.is_cuda:
        return align_pairs_triton(experts, num_experts, block_m, num_blocks)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    by_expert = flat[order]
    dest = (padded_ends - padded)[by_expert] + torch.arange(num_pairs, device=flat.device) \
        - starts[by_expert]
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32,
                          device=flat.device)
    pair_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return pair_ids, block_experts


@triton.jit
def _align_kernel(experts_ptr, pair_ids_ptr, block_experts_ptr, num_pairs, num_blocks,
                  NUM_EXPERTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr):
    """Program e < E: count every expert's pairs (a histogram), so as to know where e's
    run starts, then place e's pairs there in pair order and pad the run. Program E: the
    blocks past the last run."""
    me = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        mask = c0 + lanes < num_pairs
        e = tl.load(experts_ptr + c0 + lanes, mask=mask, other=0).to(tl.int32)
        counts += tl.histogram(e, BLOCK_E)
        counts -= tl.where(offs_e == 0, tl.sum((~mask).to(tl.int32)), 0)  # (the lanes past)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    if me < NUM_EXPERTS:
        end = tl.sum(tl.where(offs_e == me, ends, 0))
        start = end - tl.sum(tl.where(offs_e == me, padded, 0))
        placed = start
        for c0 in range(0, num_pairs, CHUNK):
            mask = c0 + lanes < num_pairs
            hit = (tl.load(experts_ptr + c0 + lanes, mask=mask, other=-1) == me).to(tl.int32)
            tl.store(pair_ids_ptr + placed + tl.cumsum(hit, axis=0) - 1, c0 + lanes,
                     mask=hit == 1)
            placed += tl.sum(hit)
        pad = placed + tl.arange(0, BLOCK_M)
        tl.store(pair_ids_ptr + pad, tl.zeros([BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=pad < end)
        for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
            tl.store(block_experts_ptr + b0 + lanes, tl.zeros([CHUNK], dtype=tl.int32) + me,
                     mask=b0 + lanes < end // BLOCK_M)
    else:
        total = tl.max(ends)
        for p0 in range(total, num_blocks * BLOCK_M, CHUNK):
            tl.store(pair_ids_ptr + p0 + lanes, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
                     mask=p0 + lanes < num_blocks * BLOCK_M)
        for b0 in range(total // BLOCK_M, num_blocks, CHUNK):
            tl.store(block_experts_ptr + b0 + lanes,
                     tl.zeros([CHUNK], dtype=tl.int32) + NUM_EXPERTS, mask=b0 + lanes < num_blocks)


def align_pairs_triton(experts: torch.Tensor, num_experts: int, block_m: int,
                       num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=experts.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=experts.device)
    chunk = max(16, min(1024, triton.next_power_of_2(experts.numel())))
    _align_kernel[(num_experts + 1,)](
        experts.contiguous(), pair_ids, block_experts, experts.numel(), num_blocks,
        NUM_EXPERTS=num_experts, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m, CHUNK=chunk)
    return pair_ids, block_experts


@triton.jit
def _expert_matmul_kernel(a_ptr, as_ptr, w_ptr, s_ptr, z_ptr, out_ptr, pair_ids_ptr,
                          block_experts_ptr, stride_a, stride_as, stride_we, stride_wn,
                          stride_se, stride_sn, stride_sg, stride_out, N, K, num_pairs,
                          NUM_EXPERTS: tl.constexpr, PAIRS_PER_ROW: tl.constexpr,
                          SCALED: tl.constexpr, A_SCALED: tl.constexpr, INT4: tl.constexpr,
                          HAS_ZERO: tl.constexpr, BITS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                          SCALE_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs
    rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if INT4:  # (tiled: this program's [words, BLOCK_N] tile of the expert)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + tl.program_id(1) * stride_wn \
            + tl.arange(0, BLOCK_N)[None, :]
    else:
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    s_offset = expert.to(tl.int64) * stride_se + (offs_n // SCALE_ROWS) * stride_sn
    s_base = s_ptr + s_offset
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if INT4:  # words [BLOCK_K / P, BLOCK_N] unpacked (P = 32 / BITS values a word)
            offs_w = k0 // (32 // BITS) + tl.arange(0, BLOCK_K // (32 // BITS))
            packed = tl.load(w_base + offs_w[:, None] * BLOCK_N,
                             mask=(offs_w < tl.cdiv(K, 32 // BITS))[:, None], other=0)
            q = unpack_tile(packed, BITS, BLOCK_K, BLOCK_N).to(tl.float32)
            at_group = (k0 // SCALE_COLS) * stride_sg
            if HAS_ZERO:
                q -= tl.load(z_ptr + s_offset + at_group, mask=mask_n, other=0.0)[None, :]
            else:
                q -= 1 << (BITS - 1)
            w = q * tl.load(s_base + at_group, mask=mask_n, other=0.0)[None, :]
        else:
            w = tl.load(w_base + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None],
                        other=0.0)  # [BLOCK_K, BLOCK_N]: w[e]^T's tile
        if INT4:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
        elif A_SCALED:  # W8A8: e4m3 rows, one scale per row and BLOCK_K columns
            part = tl.dot(a, w) * tl.load(as_ptr + rows * stride_as + k0 // BLOCK_K,
                                          mask=mask_m, other=0.0)[:, None]
            if SCALE_COLS > 0:
                part = part * tl.load(s_base + k0 // SCALE_COLS, mask=mask_n, other=0.0)[None, :]
            acc += part
        elif SCALED and SCALE_COLS > 0:  # e4m3 blocks: the tile's columns share one block
            s = tl.load(s_base + k0 // SCALE_COLS, mask=mask_n, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * s[None, :]
        else:  # (e4m3 with a scale per row: widened here, scaled once at the end)
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    if SCALED and SCALE_COLS == 0:
        acc *= tl.load(s_base, mask=mask_n, other=0.0)[None, :]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def expert_matmul(a: torch.Tensor, w: torch.Tensor, pair_ids: torch.Tensor,
                  block_experts: torch.Tensor, num_pairs: int, pairs_per_row: int,
                  block_m: int, config: tuple[int, int, int, int] | None = None,
                  scales: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                  quantize_a: bool = False,
                  int4: tuple[int, torch.Tensor | None, int] | None = None) -> torch.Tensor:
    """a [R, K] (R = num_pairs / pairs_per_row: a token's row serves its top_k pairs, or a
    pair's own row), w [E, N, K] -> [num_pairs, N]: pair p is row p // pairs_per_row of `a`
    times its expert's w[e]^T. pair_ids and block_experts from align_pairs(block_m);
    config: CONFIGS' entry for block_m unless given.

    An e4m3 w comes with fp32 `scales`: [E, ceil(N / rows), ceil(K / cols)] for `block`
    (rows, cols), else [E, N] (one per row). Each tile is widened to a's dtype as it loads
    and its products scaled (a decode step reads half the bytes of bf16 weights); with
    `quantize_a`, a is quantized to e4m3 per row and group of columns (the blocks' width,
    else 128) and the tiles multiply on FP8 tensor cores (W8A8: prompts).

    An INT4 or INT8 w comes tiled (kernels.int4_layout.tile_experts: [E, ceil(N / 128),
    ceil(K / P), 128] int32, P = 32 / bits) with `int4` (columns per scale, zero points or
    None, bits) and fp32 `scales` [E, N, groups] (zero points alike; any strides,
    kernels.int4_layout.by_group's best); each tile is unpacked and scaled as it loads."""
    if int4 is not None:
        n, k = scales.shape[1], a.shape[1]
        num_experts, tiles, words, tile_n = w.shape
        assert words == triton.cdiv(k, 32 // int4[2]) and tile_n == 128 and \
            tiles == triton.cdiv(n, 128)
        assert int4[1] is None or int4[1].stride() == scales.stride()
    else:
        num_experts, n, k = w.shape
        assert w.stride(2) == 1 and (scales is None or scales.stride(-1) == 1)
    assert a.stride(1) == 1 and a.shape[1] == k
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k, num_warps, num_stages = config or (
        FP8_CONFIGS if quantize_a else CONFIGS)[block_m]
    scale_rows, scale_cols = block or (1, 0)
    zeros = int4[1] if int4 is not None else None
    a_scales = None
    if int4 is not None:  # a K tile within one group, N tiles of the weight's
        scale_cols = min(int4[0], k)
        block_n, block_k = 128, min(block_k, int4_block_k(int4[0], k))
    elif quantize_a:
        block_k = scale_cols or GROUP
        a, a_scales = quantize_groups(a, block_k)
    elif scale_cols:  # a K tile within one block's columns
        assert scale_cols & (scale_cols - 1) == 0, "block columns: a power of two"
        block_k = min(block_k, scale_cols)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](
        a, a_scales if a_scales is not None else a, w, scales if scales is not None else w,
        zeros if zeros is not None else w, out, pair_ids, block_experts, a.stride(0),
        a_scales.stride(0) if a_scales is not None else 0, w.stride(0), w.stride(1),
        scales.stride(0) if scales is not None else 0,
        scales.stride(1) if scales is not None else 0,
        scales.stride(2) if scales is not None and scales.dim() == 3 else 0, out.stride(0),
        n, k, num_pairs,
        NUM_EXPERTS=num_experts, PAIRS_PER_ROW=pairs_per_row, SCALED=scales is not None,
        A_SCALED=quantize_a, INT4=int4 is not None, HAS_ZERO=zeros is not None,
        BITS=int4[2] if int4 is not None else 4,
        SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=num_warps,
        num_stages=num_stages)
    return out


def expert_matmul_ref(a: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
                      pairs_per_row: int) -> torch.Tensor:
    """The same, one pair at a time: experts [T, k]."""
    flat = experts.flatten()
    rows = torch.arange(flat.shape[0], device=a.device) // pairs_per_row
    return torch.stack([w[e] @ a[r] for r, e in zip(rows.tolist(), flat.tolist())])
