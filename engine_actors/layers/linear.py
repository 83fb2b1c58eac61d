"""Tensor-parallel linear layers; each parameter loads its own shard of a full checkpoint tensor.

ColumnParallelLinear splits the output features over the stage's ranks, and may stack several
checkpoint projections (q/k/v, gate/up) into one matmul. Each part is split by heads, and a
part with fewer heads than ranks (GQA's K/V with tp_size > num_kv_heads) is replicated.
RowParallelLinear splits the input features and all-reduces the partial sums. With tp_size 1
both are plain linears. Either may carry LoRA slots (`lora`, see layers/lora.py): each
token's low-rank update is added to the output (to the partial sums, before the reduce).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.layers.lora import LoRAWeights, add_lora
from engine_actors.parallel import SINGLE, ParallelGroup, shard_range


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint "
                         f"{tuple(src.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
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
        out = sum(self.part_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.lora: LoRAWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out if self.lora is None else add_lora(out, x, self.lora)

    def local_rows(self, tensor: torch.Tensor, part: int) -> tuple[int, torch.Tensor]:
        """This rank's rows of one part's full tensor (by output feature), and where they go
        in the stacked output."""
        heads, head_size = self.parts[part]
        local = self.local_heads[part]
        if heads >= self.parallel.tp_size:
            first_head, _ = shard_range(heads, self.parallel.tp_rank, self.parallel.tp_size)
        else:  # replicated: ranks share heads in order
            first_head = self.parallel.tp_rank * heads // self.parallel.tp_size
        return (sum(self.part_sizes[:part]),
                tensor.narrow(0, first_head * head_size, local * head_size))

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        part = shard or 0
        start, src = self.local_rows(tensor, part)
        copy_checked(getattr(self, name).data.narrow(0, start, self.part_sizes[part]), src)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelGroup = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.in_start, local_in = shard_range(in_features, parallel.tp_rank, parallel.tp_size)
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora: LoRAWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.parallel.all_reduce_input(x.shape[:-1] + self.weight.shape[:1], x.dtype)
        out = F.linear(x, self.weight) if buf is None else torch.matmul(x, self.weight.t(), out=buf)
        if self.lora is not None:  # A holds this rank's input columns: a partial sum too
            out = add_lora(out, x, self.lora)
        out = self.parallel.all_reduce(out)  # partial sums -> full
        return out if self.bias is None else out + self.bias

    def local_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's columns (input features) of a full [*, in_features] tensor."""
        return tensor.narrow(1, self.in_start, self.weight.shape[1])

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if name == "bias":
            copy_checked(self.bias.data, tensor)
        else:
            copy_checked(self.weight.data, self.local_columns(tensor))
