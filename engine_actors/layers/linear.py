"""Tensor-parallel linear layers; each parameter loads its own shard of a full checkpoint tensor.

ColumnParallelLinear splits the output features over the stage's ranks, and may stack several
checkpoint projections (q/k/v, gate/up) into one matmul. Each part is split by heads, and a
part with fewer heads than ranks (GQA's K/V with tp_size > num_kv_heads) is replicated.
RowParallelLinear splits the input features and all-reduces the partial sums. With tp_size 1
both are plain linears. Either may carry LoRA slots (`lora`, see layers/lora.py): each
token's low-rank update is added to the output (to the partial sums, before the reduce).
Built inside quantization.fp8_weights, either holds an e4m3 weight and its `weight_scale`
(per output row, or per block: shards then start and end on block boundaries), or an INT4
(INT8) weight packed 8 (4) to an int32 along its input features with a scale per row or group
(int4_format.py; a group is a block of one row) and, if asymmetric, a `weight_zero_point`
per scale; an act-order one also holds `weight_g_idx` [parts, K], each part's columns'
groups; or a W8A8 INT8 weight (int8 [N, K], a scale per row: its activations are quantized
per token as they come, kernels/int8.py). Once loaded, `finish_loading` sorts an act-order weight's columns by group and tiles
the weight for the kernel on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.layers.lora import LoRAWeights, add_lora
from engine_actors.parallel import SINGLE, ParallelGroup, shard_range
from engine_actors.int4_format import Int4Format, W8A8Format
from engine_actors.quantization import building_format, quantize_weight_rows
from kernels.fp8 import fp8_linear
from kernels.fp8_quantize import FP8
from kernels.int4 import int4_linear
from kernels.int8 import int8_linear
from kernels.int4_layout import by_group, sort_columns, tile, tile_parts


# a quantized weight's tensors shaped as its scales (sharded alike)
SCALES = ("weight_scale", "weight_zero_point")


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint "
                         f"{tuple(src.shape)}")
    dst.copy_(src)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Linear(nn.Module):
    """The weight (and bias) of either layer, in the model's dtype or in FP8."""

    def make_weight(self, out_features: int, in_features: int, bias: bool, parts: int = 1
                    ) -> None:
        self.quant = building_format()
        self.int4 = isinstance(self.quant, Int4Format)
        self.w8a8 = isinstance(self.quant, W8A8Format)
        self.in_features, self.out_features = in_features, out_features  # (this rank's)
        dtype = torch.int32 if self.int4 else torch.int8 if self.w8a8 else \
            FP8 if self.quant is not None else None
        self.weight = nn.Parameter(torch.empty(out_features, cdiv(in_features, self.quant.per_word) if self.int4
                                               else in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora: LoRAWeights | None = None
        if self.quant is not None:
            rows, cols = self.quant.block or (1, in_features)
            shape = (out_features,) if self.quant.block is None else \
                (cdiv(out_features, rows), cdiv(in_features, cols))
            self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32),
                                             requires_grad=False)
        self.order = None  # an act-order weight's stored column order, made once loaded
        if self.int4 and self.quant.act_order:
            self.weight_g_idx = nn.Parameter(torch.empty(parts, in_features, dtype=torch.int32),
                                             requires_grad=False)
        if self.int4 and self.quant.zero_points:
            self.weight_zero_point = nn.Parameter(torch.empty(shape, dtype=torch.float32),
                                                  requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if self.int4:
            group = self.quant.group or self.in_features
            return int4_linear(x, self.weight, self.weight_scale, group, self.in_features,
                               bias, out, self.order, getattr(self, "weight_zero_point", None),
                               self.quant.bits)
        if self.w8a8:
            return int8_linear(x, self.weight, self.weight_scale, bias, out)
        if self.quant is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.quant.block, bias, out)
        if out is not None:
            return torch.matmul(x, self.weight.t(), out=out)
        return F.linear(x, self.weight, bias)

    def part_rows(self) -> list[tuple[int, int]]:
        return [(0, self.out_features)]

    def finish_loading(self) -> None:
        """Once loaded, an INT4 weight on the GPU is stored as the kernels read it (an
        act-order one's columns sorted by group first; kernels.int4_layout.tile, by_group)."""
        if self.int4 and self.quant.act_order:
            self.weight.data, self.order = sort_columns(
                self.weight.data, self.weight_g_idx.data, self.part_rows(),
                self.quant.group or self.in_features, self.in_features, self.quant.bits)
            if self.order is not None and self.weight.is_cuda:
                self.order = tile_parts(self.order, self.out_features)
        if self.int4 and self.weight.is_cuda:
            self.weight = nn.Parameter(tile(self.weight.data), requires_grad=False)
            self.weight_scale.data = by_group(self.weight_scale.data)
            if self.quant.zero_points:
                self.weight_zero_point.data = by_group(self.weight_zero_point.data)

    def scale_rows(self, tensor: torch.Tensor, rows: int) -> torch.Tensor:
        """A checkpoint's per-channel or per-tensor scale as one scale per output row."""
        return tensor.reshape(-1).expand(rows) if tensor.numel() == 1 else tensor.reshape(rows)

    def check_stored(self, name: str, tensor: torch.Tensor) -> bool:
        """An FP8 checkpoint's weights must be stored in e4m3 (not, say, fake-quantized bf16
        with the scales beside them, which would be cast here and scaled twice); a tensor
        this layer has no place for (a zero point, a g_idx, a sparsity mask) is refused,
        except a W8A8 weight's zero points if all zero (symmetric, as some writers keep
        them): False, skip it."""
        if name == "weight_zero_point" and self.w8a8:
            if tensor.any():
                raise ValueError("a W8A8 INT8 checkpoint's weight zero points are not all "
                                 "zero (its quantization config says symmetric)")
            return False
        if name not in ("weight", "bias", "weight_scale", "weight_zero_point",
                        "weight_g_idx") or (
                name == "weight_scale" and self.quant is None) or (
                name == "weight_zero_point" and not (self.int4 and self.quant.zero_points)) or (
                name == "weight_g_idx" and not (self.int4 and self.quant.act_order)):
            raise ValueError(f"a projection's {name!r} tensor is not served here (a "
                             "quantization format this engine does not read)")
        if name == "weight" and self.w8a8 and tensor.dtype != torch.int8:
            raise ValueError(f"a W8A8 INT8 checkpoint's weight is stored as {tensor.dtype}, "
                             "not int8 (compressed-tensors' format must be int-quantized)")
        if name == "weight" and self.int4 and tensor.dtype != torch.int32:
            raise ValueError(f"an {self.quant.name} checkpoint's weight is stored as "
                             f"{tensor.dtype}, not int32 words of packed {self.quant.bits}-bit "
                             "values (weight_packed)")
        if name == "weight" and self.quant is not None and not self.quant.online \
                and not self.int4 and not self.w8a8 and tensor.dtype != FP8:
            raise ValueError(f"an FP8 checkpoint's weight is stored as {tensor.dtype}, not "
                             "float8_e4m3fn (compressed-tensors' format must be "
                             "float-quantized)")
        return True

    def check_blocks(self, starts_and_sizes, what: str) -> None:
        """Shards of a block-scaled weight must start and end on block boundaries."""
        for start, size, unit, last in starts_and_sizes:
            if start % unit or (size % unit and not last):
                what_unit = f"{self.quant.name} weight groups of {unit} columns" if self.int4 \
                    else \
                    f"FP8 weight blocks of {list(self.quant.block)}"
                raise ValueError(f"{what_unit} do not divide "
                                 f"this model's {what} features into whole blocks ({size} "
                                 f"from {start}, a part or a tensor-parallel shard)")


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool = False,
                 parallel: ParallelGroup = SINGLE):
        """parts: (num_heads, head_size) of each stacked projection; a plain linear is
        [(out_features, 1)]."""
        super().__init__()
        self.parallel = parallel
        self.parts = parts
        # rows of each part held here: heads split evenly, or one replicated head
        self.local_heads = [heads // parallel.tp_size if heads >= parallel.tp_size else 1
                            for heads, _ in parts]
        self.part_sizes = [n * size for n, (_, size) in zip(self.local_heads, parts)]
        self.make_weight(sum(self.part_sizes), in_features, bias, len(parts))
        if self.quant is not None and self.quant.block is not None:
            single = len(parts) == 1 and parallel.tp_size == 1  # (may end in a partial block)
            self.check_blocks([(self.first_row(p), size, self.quant.block[0], single)
                               for p, size in enumerate(self.part_sizes)], "output")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else add_lora(out, x, self.lora)

    def part_rows(self) -> list[tuple[int, int]]:
        ends = torch.tensor(self.part_sizes).cumsum(0).tolist()
        return [(end - size, end) for end, size in zip(ends, self.part_sizes)]

    def first_row(self, part: int) -> int:
        """The row of one part's full tensor where this rank's rows begin."""
        heads, head_size = self.parts[part]
        if heads >= self.parallel.tp_size:
            return shard_range(heads, self.parallel.tp_rank, self.parallel.tp_size)[0] * head_size
        return self.parallel.tp_rank * heads // self.parallel.tp_size * head_size  # replicated

    def local_rows(self, tensor: torch.Tensor, part: int) -> tuple[int, torch.Tensor]:
        """This rank's rows of one part's full tensor (by output feature), and where they go
        in the stacked output."""
        return (sum(self.part_sizes[:part]),
                tensor.narrow(0, self.first_row(part), self.part_sizes[part]))

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if not self.check_stored(name, tensor):
            return
        part = shard or 0
        size = self.part_sizes[part]
        if name == "weight_g_idx":  # (by input column: every rank's)
            return copy_checked(self.weight_g_idx.data[part], tensor)
        if name in SCALES and self.quant.block is not None:  # rows of blocks
            rows = self.quant.block[0]
            src = tensor.narrow(0, self.first_row(part) // rows, cdiv(size, rows))
            start, size = sum(self.part_sizes[:part]) // rows, src.shape[0]
        elif name in SCALES:
            heads, head_size = self.parts[part]
            start, src = self.local_rows(self.scale_rows(tensor, heads * head_size), part)
        else:
            start, src = self.local_rows(tensor, part)
        if name == "weight" and self.quant is not None and self.quant.online:
            src, scales = quantize_weight_rows(src)
            self.weight_scale.data.narrow(0, start, size).copy_(scales)
        copy_checked(getattr(self, name).data.narrow(0, start, size), src)


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelGroup = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.in_start, local_in = shard_range(in_features, parallel.tp_rank, parallel.tp_size)
        self.make_weight(out_features, local_in, bias)
        if self.int4 and self.quant.act_order and parallel.tp_size > 1:
            raise ValueError(f"act-order {self.quant.name} weights (GPTQ's desc_act, "
                             "actorder \"group\") "
                             "are served at tensor_parallel_size 1: a shard of a layer's input "
                             "columns would hold parts of every group")
        if self.quant is not None and (self.quant.block is not None or self.int4):
            # (INT4 by channel: shards of whole words)
            self.check_blocks([(self.in_start, local_in,
                                self.quant.block[1] if self.quant.block else
                                self.quant.per_word,
                                parallel.tp_rank == parallel.tp_size - 1)], "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.parallel.all_reduce_input(x.shape[:-1] + (self.out_features,), x.dtype)
        out = self.matmul(x, out=buf)
        if self.lora is not None:  # A holds this rank's input columns: a partial sum too
            out = add_lora(out, x, self.lora)
        out = self.parallel.all_reduce(out)  # partial sums -> full
        return out if self.bias is None else out + self.bias

    def local_columns(self, tensor: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """This rank's columns (input features) of a full [*, in_features] tensor; packed:
        of an INT4 weight's words (a shard starts on a group: a whole number of words)."""
        if packed:
            return tensor.narrow(1, self.in_start // self.quant.per_word, self.weight.shape[1])
        return tensor.narrow(1, self.in_start, self.in_features)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if not self.check_stored(name, tensor):
            return
        if name == "bias":
            copy_checked(self.bias.data, tensor)
        elif name == "weight_g_idx":
            copy_checked(self.weight_g_idx.data[0], tensor)
        elif name in SCALES and self.quant.block is not None:  # columns of blocks
            cols = self.quant.block[1]
            copy_checked(getattr(self, name).data,
                         tensor.narrow(1, self.in_start // cols, self.weight_scale.shape[1]))
        elif name in SCALES:  # (one per output row: every rank's)
            copy_checked(getattr(self, name).data, self.scale_rows(tensor, self.out_features))
        elif self.quant is not None and self.quant.online:
            weight, scales = quantize_weight_rows(self.local_columns(tensor))
            copy_checked(self.weight.data, weight)
            self.weight_scale.data.copy_(scales)
        else:
            copy_checked(self.weight.data, self.local_columns(tensor, packed=self.int4))
