"""Attention over a flattened iteration, reading keys/values from the paged KV pool.

Interface (shared by the reference and the Triton kernel):
  q             [T, Hq, D]   queries of every new token of the iteration, requests concatenated
  k_cache       [S, Hkv, D]  the layer's key pool, S = num_blocks * block_size token slots
  v_cache       [S, Hkv, D]
  cu_seqlens_q  [B+1] int32  request i owns q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]
  seq_lens      [B] int32    tokens of request i in the cache, the new ones included
  block_tables  [B, M] int32 block ids of request i, in position order
  max_query_len int          the longest q_len (host value: sizes the launch grid)
A request's new tokens are the last ones of its sequence: query j of request i sits at
position seq_lens[i] - q_len_i + j and attends causally to positions 0..that position (with
a sliding `window` W > 0, only to the last W of them, itself included, as transformers'
sliding-window layers). Prefill, chunked prefill and decode (q_len 1) are the same case.
GQA: Hq % Hkv == 0. With a `softcap` c > 0 (Gemma 2's attention logit soft-capping), scores
s become c * tanh(s / c) before the softmax. An FP8 pool (kernels/kv_write.py) holds keys
and values divided by `k_scale` and `v_scale`: they are read as q's dtype, and the scales
multiply the scores' scale and the output (no multiply per element).

The Triton kernel runs every request in one launch (ORCA fuses the per-request attention
blocks into one kernel): program (i, j, h) takes query tile j of request i for KV head h,
with the GROUP query heads that share that KV head stacked as rows, so K/V are read once
per group. It streams K/V through the block table with an online softmax (flash
attention), up to the causal limit of its tile.

Inside a CUDA graph the launch grid cannot follow the step: there the kernel takes a work
list instead (`work_list`), one (request, tile) per program over a fixed grid that any step
of the graph's token and request counts fits, with (-1, 0) for programs left over.

A decode step of too few (request, KV head) programs to fill the GPU splits each request's
keys into `splits` chunks (flash decoding): program (i, s, h) takes chunk s, keeps
its unnormalised output with its running max and sum, and a second kernel merges the chunks.
The chunks follow each request's length on the device, so a CUDA graph's fixed grid serves
any context. A work list made with `splits` gives each decode row (one query token) of a
step with prompts that many items, one per chunk, and its prompt rows their tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.split_kv import decode_splits, merge_splits_kernel


def paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                        block_size: int, scale: float, max_query_len: int = 0,
                        work: torch.Tensor | None = None, window: int = 0,
                        softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                        splits: int | None = None) -> torch.Tensor:
    """Per-request attention in plain torch (ORCA's split -> attention -> merge); `work`
    and `splits` are the kernel's launch choices, and do not change the result."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache[slots].to(q.dtype).repeat_interleave(group, dim=1) * k_scale  # [L, Hq, D]
        v = v_cache[slots].to(q.dtype).repeat_interleave(group, dim=1) * v_scale
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale  # [Hq, q_len, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = pos[seq_len - q_len:, None]  # [q_len, 1]
        hidden = pos[None, :] > q_pos
        if window:
            hidden |= pos[None, :] <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        block_tables_ptr, work_ptr, part_ptr, part_count, scale_log2e, cap_log2e, v_scale,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_P2: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WORK: tl.constexpr,
        WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DOT: tl.constexpr, SPLITS: tl.constexpr):
    if WORK:  # program i takes the (request, tile) of work item i
        req = tl.load(work_ptr + 2 * tl.program_id(0))
        tile = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
        if req < 0:
            return
    else:
        req = tl.program_id(0)
        tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    split = 0
    if SPLITS > 1:  # a decode row's "tile" is its chunk of keys (a prompt row's, its tile)
        split = tl.where(q_len == 1, tile, 0)
        tile = tl.where(q_len == 1, 0, tile)
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos = seq_len - q_len  # position of the request's first new token

    rows = tl.arange(0, ROWS)  # row = (token of the tile, head of the group), padded to 2^k
    tok = tile * BLOCK_M + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_M * GROUP) & (tok < q_len)
    # a head size that is not a power of two (80, 96, 112, ...) is padded with masked zeros
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT)
    q_pos = first_pos + tok

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_P2], tl.float32)
    # keys past the tile's last query position are masked for every row: skip them (and
    # with a window, keys before its first query's window)
    kv_end = tl.minimum(seq_len, first_pos + (tile + 1) * BLOCK_M)
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(first_pos + tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    if SPLITS > 1:  # whole loop iterations per chunk; the last chunks may be empty
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, tl.where(q_len == 1, SPLITS, 1)),
                        BLOCK_N) * BLOCK_N
        kv_begin += split * chunk
        kv_end = tl.minimum(kv_end, kv_begin + chunk)
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(block_tables_ptr + req * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_offs = slot[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
        kv_ok = n_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [R, N]
        if SOFTCAP:  # c log2(e) tanh(s / (c log2(e))), in the log2 domain; tanh(x) = 2 / (1
            s = cap_log2e * (2.0 / (1.0 + tl.exp(-2.0 * s / cap_log2e)) - 1.0)  # + e^-2x) - 1
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOW > 0:  # a row may see no key of a block yet: no inf - inf
            m_new = tl.where(m_new == float("-inf"), -1e30, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
        m_i = m_new
    out_ok = row_ok
    if SPLITS > 1:  # a decode row's partial sums at [request, q head, chunk]: m, l, acc
        at = (req * tl.num_programs(2) * GROUP + head) * SPLITS + split
        # (a block compared, not a scalar: the interpreter's block & scalar is no mask)
        part_ok = row_ok & (rows < tl.where(q_len == 1, ROWS, 0))
        tl.store(part_ptr + at, m_i, mask=part_ok)
        tl.store(part_ptr + part_count + at, l_i, mask=part_ok)
        tl.store(part_ptr + 2 * part_count + at[:, None] * DIM_P2 + dims[None, :], acc,
                 mask=part_ok[:, None])
        out_ok = row_ok & (rows >= tl.where(q_len == 1, ROWS, 0))
    out = acc * (v_scale / l_i)[:, None]  # (an empty chunk's 0 / 0 is never stored)
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=out_ok[:, None] & dim_ok[None, :])


def tile_shape(num_q_heads: int, num_kv_heads: int, head_dim: int,
               max_query_len: int) -> tuple[int, int, int]:
    """(query tokens per tile, rows per program, padded head size) of a launch: at least 16
    rows for tl.dot, and a larger tile when prompts are being prefilled."""
    group = num_q_heads // num_kv_heads
    dim_p2 = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    rows = 16 if max_query_len == 1 else (64 if dim_p2 > 64 else 128)
    block_m = max(rows // group, 1)
    return block_m, triton.next_power_of_2(block_m * group), dim_p2


def work_list(cu_seqlens_q: torch.Tensor, block_m: int, num_work: int,
              splits: int = 1) -> torch.Tensor:
    """[num_work, 2] int32: (request, query tile) of each program, request by request, then
    (-1, 0); with `splits`, a decode row's items are (request, chunk) for each of its
    chunks. Device ops only (no host sync), so it runs inside a CUDA graph. A step of T
    tokens in B requests has at most cdiv(T, block_m) + B * splits items."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tiles = (q_lens + block_m - 1) // block_m
    if splits > 1:
        tiles = torch.where(q_lens == 1, splits, tiles)
    ends = torch.cumsum(tiles, 0)
    item = torch.arange(num_work, device=cu_seqlens_q.device)
    req = torch.searchsorted(ends, item, right=True)  # the first request ending past item
    last = tiles.shape[0] - 1
    tile = item - (ends - tiles)[req.clamp(max=last)]
    real = req <= last
    return torch.stack([torch.where(real, req, -1), torch.where(real, tile, 0)], 1).int()


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype):
    """The products' input type: q's, except fp16 for 16-bit queries over an FP8 pool (e4m3
    and e5m2 widen to fp16 in one conversion, to bf16 in several; bf16 queries widen to
    fp16 exactly within its range)."""
    if q_dtype == torch.float32:
        return tl.float32
    return tl.float16 if q_dtype == torch.float16 or kv_dtype.itemsize == 1 else tl.bfloat16


def block_n(dim_p2: int, kv_dtype: torch.dtype, max_query_len: int) -> int:
    """Keys per loop iteration. An FP8 pool's decode steps take twice as many: as many bytes
    per iteration as a 16-bit pool's (BENCHMARKS.md, 2026-11-29: 1.3x faster at 4,096
    tokens of context than 64 keys)."""
    keys = 64 if dim_p2 <= 128 else 32
    return keys * 2 if kv_dtype.itemsize == 1 and max_query_len == 1 else keys


def paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                           block_size: int, scale: float, max_query_len: int,
                           work: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0, k_scale: float = 1.0,
                           v_scale: float = 1.0, splits: int | None = None) -> torch.Tensor:
    """work: a work list made by work_list with the block_m of tile_shape(..., max_query_len).
    splits: chunks per decode row's keys (a power of two): a work list's own (None: 1); in a
    decode-only step without one, None lets decode_splits choose; other steps never split."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    assert num_q_heads % num_kv_heads == 0 and 8 <= head_dim <= 256
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert cu_seqlens_q.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    block_m, rows, dim_p2 = tile_shape(num_q_heads, num_kv_heads, head_dim, max_query_len)
    out = torch.empty_like(q)
    num_reqs = seq_lens.shape[0]
    if work is not None:
        splits = splits or 1
    elif max_query_len > 1:
        splits = 1
    elif splits is None:
        splits = decode_splits(num_reqs, num_kv_heads, q.device) if q.is_cuda else 1
    assert splits & (splits - 1) == 0, "splits must be a power of two"
    if work is None:
        grid = (num_reqs, max(triton.cdiv(max_query_len, block_m), splits), num_kv_heads)
    else:
        grid = (work.shape[0], 1, num_kv_heads)
    # m, l and acc of each (request, q head, chunk), fp32
    count = num_reqs * num_q_heads * splits if splits > 1 else 0
    part = out if splits == 1 else torch.empty(count * (2 + dim_p2), dtype=torch.float32,
                                               device=q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
        cu_seqlens_q if work is None else work, part, count,
        scale * k_scale * 1.4426950408889634,
        softcap * 1.4426950408889634, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, DIM_P2=dim_p2, BLOCK_M=block_m,
        ROWS=rows, BLOCK_N=block_n(dim_p2, k_cache.dtype, max_query_len),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WORK=work is not None,
        WINDOW=window, SOFTCAP=softcap > 0, DOT=dot_dtype(q.dtype, k_cache.dtype),
        SPLITS=splits, num_stages=2 if k_cache.dtype.itemsize == 1 and max_query_len > 1 else 3)
    if splits > 1:
        merge_splits_kernel[(num_reqs, num_q_heads)](
            part, out, cu_seqlens_q, v_scale, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            DIM_P2=dim_p2, SPLITS=splits)
    return out


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, block_size,
                    scale, max_query_len, work=None, window: int = 0, softcap: float = 0.0,
                    k_scale: float = 1.0, v_scale: float = 1.0, splits: int | None = None):
    fn = paged_attention_triton if q.is_cuda else paged_attention_ref
    return fn(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, block_size, scale,
              max_query_len, work, window, softcap, k_scale, v_scale, splits)
