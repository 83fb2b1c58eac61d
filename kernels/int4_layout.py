"""How INT4 weights (W4A16), and INT8 ones (W8A16) alike, are packed and stored, for
kernels/int4.py and kernels/moe.py.

compressed-tensors' pack-quantized layout, for b bits (4 or 8; P = 32 / b values a word):
element k of a row is bits b (k % P) .. +b-1 of word k // P, as an unsigned value u offset
by 2^(b-1) (q = u - 8 for 4 bits, in [-8, 7]; u - 128 for 8); each row has a scale per
group of `group` columns, w ~ q * scale (symmetric). Weights with zero points (AWQ's,
asymmetric GPTQ's) also have a zero point z per scale, w ~ (u - z) * scale (fp32 [N,
groups], shaped as the scales).

On the GPU a weight is stored tiled (`tile`, once, as it loads): each block of TILE_N rows
is transposed to [words, TILE_N], so that a [BLOCK_K, TILE_N] tile of a kernel is one
contiguous read; experts alike, one at a time (`tile_experts`); scales and zero points are
stored group by group (`by_group`), so that a tile's are one contiguous read too.

Act-order weights (GPTQ's desc_act, a g_idx mapping each input column to its group) are
stored with each part's columns sorted by group (`sort_columns`, `ColumnOrder`), so that
groups are contiguous as above.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

TILE_N = 128  # rows per stored tile


def per_word(bits: int) -> int:
    """Values packed in an int32: 8 of 4 bits, 4 of 8."""
    return 32 // bits


class ColumnOrder(NamedTuple):
    """An act-order weight's stored column order: stored column i of part p (the rows
    rows[p]) is input column columns[p, i]; tile_part: each tile's part (on the GPU)."""
    columns: torch.Tensor  # [parts, K] int64
    rows: tuple[tuple[int, int], ...]
    tile_part: torch.Tensor | None = None  # [tiles] int32


def tile(w: torch.Tensor) -> torch.Tensor:
    """Plain packed w [N, words] as [ceil(N / TILE_N), words, TILE_N] (rows past N: zeros)."""
    n, words = w.shape
    padded = torch.zeros(triton.cdiv(n, TILE_N) * TILE_N, words, dtype=w.dtype, device=w.device)
    padded[:n] = w
    return padded.view(-1, TILE_N, words).transpose(1, 2).contiguous()


def sort_columns(w: torch.Tensor, g_idx: torch.Tensor, rows: list[tuple[int, int]],
                 group: int, k: int, bits: int = 4) -> tuple[torch.Tensor, ColumnOrder | None]:
    """An act-order weight (plain packed w [N, words]; g_idx [parts, k]: the group of each
    input column of each part, the rows rows[p]) with each part's columns sorted by group,
    and their order (None: already in order). ValueError if a group has other than `group`
    columns (the last: what is left)."""
    g_idx = g_idx.long()
    columns = torch.argsort(g_idx, dim=1, stable=True)
    expected = torch.arange(k, device=w.device) // group
    if not torch.equal(torch.gather(g_idx, 1, columns), expected.expand_as(columns)):
        raise ValueError(f"an act-order g_idx whose groups are not {group} columns each")
    if torch.equal(columns, torch.arange(k, device=w.device).expand_as(columns)):
        return w, None
    values = unpack(w, k, bits)
    for (start, end), part in zip(rows, columns):
        values[start:end] = values[start:end, part]
    return pack(values, bits), ColumnOrder(columns, tuple(rows))


def tile_parts(order: ColumnOrder, n: int) -> ColumnOrder:
    """order with each tile's part, for the GPU's kernels: a part's rows must start on a
    tile (ValueError if not)."""
    starts = [start for start, _ in order.rows]
    if any(start % TILE_N for start in starts):
        raise ValueError(f"act-order integer weights on the GPU need each stacked projection "
                         f"(q/k/v, gate/up) to start on a multiple of {TILE_N} rows; this "
                         f"layer's start at rows {starts}")
    tiles = torch.arange(0, triton.cdiv(n, TILE_N) * TILE_N, TILE_N)
    part = torch.bucketize(tiles, torch.tensor(starts), right=True) - 1
    return order._replace(tile_part=part.to(torch.int32).to(order.columns.device))


def tile_experts(w: torch.Tensor) -> torch.Tensor:
    """Experts' plain packed w [E, N, words] tiled one expert at a time: [E, ceil(N /
    TILE_N), words, TILE_N]."""
    return torch.stack([tile(expert) for expert in w])


def by_group(t: torch.Tensor) -> torch.Tensor:
    """Scales (or zero points) [..., N, groups] as the GPU's kernels read them best: a view
    of them stored group by group ([..., groups, N]), so that a tile's are one contiguous
    read."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t


def group_strides(scales: torch.Tensor, zeros: torch.Tensor | None) -> tuple[int, int]:
    """The strides of scales [N, groups] or [N] (zeros: the same), by row and by group."""
    if zeros is not None and zeros.stride() != scales.stride():
        raise ValueError("INT4 zero points must be stored as their scales are")
    return scales.stride(0), scales.stride(1) if scales.dim() == 2 else 0


def unpack(w: torch.Tensor, k: int, bits: int = 4) -> torch.Tensor:
    """Plain packed w [N, words] as its unsigned values [N, k] (int32, 0 .. 2^bits - 1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1)[:, :k]


def pack(u: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """unpack's inverse: values [N, k] (0 .. 2^bits - 1) as words [N, ceil(k / P)] int32."""
    n = per_word(bits)
    u = torch.nn.functional.pad(u.to(torch.int32), (0, -u.shape[1] % n))
    u = u.view(u.shape[0], -1, n)
    words = u[..., 0].clone()
    for j in range(1, n):
        words |= u[..., j] << (bits * j)
    return words
