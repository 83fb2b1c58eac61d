"""A decode step's matmul has few rows: its column tiles alone leave most SMs idle while
the weights stream. Splitting the K range over several programs fills them; each writes
its fp32 partial sums, and `add_splits` adds them up in a fixed order (deterministic, no
atomics), with the bias, in the output's dtype. Used by the INT4 and FP8 weight kernels."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_SPLIT = 8
PROGRAMS_PER_SM = 4


@triton.jit
def _add_splits_kernel(part_ptr, c_ptr, bias_ptr, total, N, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + i * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(x: torch.Tensor, tiles: int, k_tiles: int, split_k: int | None) -> int:
    """Programs along K for `tiles` output tiles: split_k if given, else enough for about
    PROGRAMS_PER_SM programs per SM (a power of two, at most MAX_SPLIT); never more than
    the K tiles (1 off the GPU, where the Triton interpreter runs the kernels)."""
    if split_k is None:
        want = triton.cdiv(PROGRAMS_PER_SM * _num_sms(x.device.index or 0), tiles) \
            if x.is_cuda else 1
        split_k = min(MAX_SPLIT, triton.next_power_of_2(want))
    return max(1, min(split_k, k_tiles))


def plan(x: torch.Tensor, tiles: int, k: int, block_k: int, out: torch.Tensor,
         split_k: int | None) -> tuple[int, int, torch.Tensor]:
    """(programs along K, the K columns of each, where the kernel writes: out itself, or
    fp32 partial sums [split, M, N] for add_splits) for `tiles` output tiles."""
    split = num_splits(x, tiles, triton.cdiv(k, block_k), split_k)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)
    part = out if split == 1 else torch.empty(split, *out.shape, dtype=torch.float32,
                                              device=out.device)
    return split, k_per_split, part


def add_splits(part: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out [M, N] = the sum over part [split, M, N] (+ bias)."""
    split, m, n = part.shape
    _add_splits_kernel[(triton.cdiv(m * n, 1024),)](
        part, out, bias if bias is not None else out, m * n, n, SPLIT=split,
        HAS_BIAS=bias is not None, BLOCK=1024)
