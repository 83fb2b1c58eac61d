"""Flash decoding's second half, for kernels/attention.py: how many chunks a decode row's
keys are split into (`decode_splits`), and the kernel that merges the chunks' partial sums
into each row's output."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def merge_splits_kernel(part_ptr, out_ptr, cu_seqlens_q_ptr, v_scale, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, SPLITS: tl.constexpr):
    """Program (i, h): request i's output for query head h from its chunks' partial sums,
    if it is a decode row (a prompt row's came whole; a padding request has none)."""
    req, head = tl.program_id(0), tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    if tl.load(cu_seqlens_q_ptr + req + 1) - q_start != 1:
        return
    at = (req * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
    count = tl.num_programs(0) * tl.num_programs(1) * SPLITS
    m = tl.load(part_ptr + at)  # log2 domain; -inf for an empty chunk
    weight = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(weight * tl.load(part_ptr + count + at), 0)
    dims = tl.arange(0, DIM_P2)
    acc = tl.load(part_ptr + 2 * count + at[:, None] * DIM_P2 + dims[None, :])
    out = tl.sum(weight[:, None] * acc, 0) * (v_scale / total)
    tl.store(out_ptr + q_start * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Chunks per request's keys in a decode step: the most, a power of two up to
    MAX_SPLITS, that keep the (request, KV head, chunk) programs within PROGRAMS_PER_SM per
    SM. On an H200 with llama-8b's heads the fastest split had ~4 per SM at every batch from
    1 to 64 (BENCHMARKS.md, 2026-11-29: 17.8x faster attention at one request of 32k)."""
    if torch.device(device).type != "cuda":  # (the reference attention never splits)
        return 1
    room = PROGRAMS_PER_SM * _num_sms(device) // max(num_reqs * num_kv_heads, 1)
    return min(MAX_SPLITS, 1 << max(room.bit_length() - 1, 0))


MAX_SPLITS, PROGRAMS_PER_SM = 32, 4


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
