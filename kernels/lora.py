"""Many LoRA adapters in one launch: y[t] += (x[t] @ A[s]^T) @ B[s]^T for each token t of an
adapter slot s (tokens of the base model are left alone).

The tokens with an adapter are grouped by slot (`group_tokens`): `order` lists them slot by
slot, and tiles (first, end, slot) cut each slot's run of `order` into at most TILE tokens,
so a decode batch of 64 requests over 8 adapters is 8 tiles that read each adapter's weights
once (Punica's segmented gather, SGMV). Slot -1 marks an empty tile: the padding of a CUDA
graph's fixed grid. Two kernels: `shrink` computes v = x A^T per tile, its K split across
programs so that a few tiles still fill the GPU (each split stores its partial sum: no
atomics, no zeroed buffer); `expand` sums the partials and adds v B^T into y. A: [S, R, K];
B: [S, N, R], the LoRA scale already folded into B; R is the slot rank (padded; stacked
projections stack their ranks).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

TILE = 16  # tokens per tile (the smallest tl.dot M)
PROGRAMS = 1024  # shrink: split K until about this many programs run
K_PER_PROGRAM = 512  # shrink: the least K a program of a split takes


def max_tiles(num_tokens: int, num_slots: int, tile: int = TILE) -> int:
    """The most tiles `group_tokens` makes: each slot's run adds at most one partial tile."""
    return min(num_tokens, num_tokens // tile + num_slots)


def group_tokens(token_slots: np.ndarray, tile: int = TILE
                 ) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """token_slots [T] (-1: the base model) -> (order: the adapter tokens grouped by slot,
    tiles: (first, end, slot) over positions in order)."""
    tokens = np.flatnonzero(token_slots >= 0)
    order = tokens[np.argsort(token_slots[tokens], kind="stable")].astype(np.int32)
    slots = token_slots[order]
    bounds = np.flatnonzero(np.diff(slots)) + 1
    tiles = []
    for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), len(order)]):
        if end > start:
            slot = int(slots[start])
            tiles += [(t, min(t + tile, end), slot) for t in range(start, end, tile)]
    return order, tiles


def lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots) -> torch.Tensor:
    """In place on y [T, N]: x [T, K], a [S, R, K], b [S, N, R]; token_slots [T] (-1: none)."""
    token_slots = torch.as_tensor(np.asarray(token_slots), device=y.device)
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            idx = (token_slots == slot).nonzero().squeeze(1)
            y[idx] += (x[idx] @ a[slot].T) @ b[slot].T
    return y


@triton.jit
def _tile(tiles_ptr, order_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its slot (-1: empty), positions in order, their mask, tokens."""
    tile = tl.program_id(0)
    start = tl.load(tiles_ptr + tile * 3)
    end = tl.load(tiles_ptr + tile * 3 + 1)
    slot = tl.load(tiles_ptr + tile * 3 + 2)
    offs_p = start + tl.arange(0, BLOCK_M)
    mask_p = offs_p < end
    tokens = tl.load(order_ptr + offs_p, mask=mask_p, other=0)
    return slot, offs_p, mask_p, tokens


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, v_ptr, order_ptr, tiles_ptr, stride_x, stride_as, stride_ar,
                   stride_vs, stride_v, K, K_PER_SPLIT, R: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    slot, offs_p, mask_p, tokens = _tile(tiles_ptr, order_ptr, BLOCK_M)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                    mask=mask_p[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=mask_r[None, :] & mask_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(v_ptr + split * stride_vs + offs_p[:, None] * stride_v + offs_r[None, :], acc,
             mask=mask_p[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(v_ptr, b_ptr, y_ptr, order_ptr, tiles_ptr, stride_vs, stride_v, stride_bs,
                   stride_bn, stride_y, N, SPLITS, R: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    slot, offs_p, mask_p, tokens = _tile(tiles_ptr, order_ptr, BLOCK_M)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_r = offs_r < R
    mask_n = offs_n < N
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(SPLITS):  # the shrink's partial sums, in a fixed order
        v += tl.load(v_ptr + split * stride_vs + offs_p[:, None] * stride_v + offs_r[None, :],
                     mask=mask_p[:, None] & mask_r[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=mask_n[None, :] & mask_r[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]
    out = tl.dot(v.to(b.dtype), b, input_precision=PRECISION)
    ptrs = y_ptr + tokens[:, None] * stride_y + offs_n[None, :]
    mask = mask_p[:, None] & mask_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (y.to(tl.float32) + out).to(y.dtype), mask=mask)


def lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                order: torch.Tensor, tiles: torch.Tensor, tile: int = TILE,
                block_n: int = 256) -> torch.Tensor:
    """In place on y [T, N]; order [<= T] and tiles [n, 3]: int32 on the device, from
    `group_tokens` with the same `tile` (padded to a fixed size under a CUDA graph)."""
    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return y
    _, rank, k = a.shape
    n = b.shape[1]
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    block_r, block_k = max(16, triton.next_power_of_2(rank)), 128
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding
    splits = max(1, min(PROGRAMS // num_tiles, triton.cdiv(k, K_PER_PROGRAM)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    v = torch.empty(splits, max(order.shape[0], 1), rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tiles, splits)](
        x, a, v, order, tiles, x.stride(0), a.stride(0), a.stride(1), v.stride(0), v.stride(1),
        k, k_per_split, R=rank, BLOCK_M=tile, BLOCK_R=block_r, BLOCK_K=block_k,
        PRECISION=precision)
    _expand_kernel[(num_tiles, triton.cdiv(n, block_n))](
        v, b, y, order, tiles, v.stride(0), v.stride(1), b.stride(0), b.stride(1), y.stride(0),
        n, splits, R=rank, BLOCK_M=tile, BLOCK_R=block_r, BLOCK_N=block_n,
        PRECISION=precision)
    return y
