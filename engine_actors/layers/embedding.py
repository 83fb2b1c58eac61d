"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the rows.

The vocabulary is padded to a multiple of tp_size; padded rows are zero and their logits
are cut off after the gather.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_actors.parallel import SINGLE, ParallelGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelGroup = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // parallel.tp_size)  # rows per rank
        self.start = parallel.tp_rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None]
        return self.parallel.all_reduce(out)  # exactly one rank contributes each row

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if name != "weight" or not tensor.is_floating_point() or tensor.dtype.itemsize == 1:
            raise ValueError(f"a quantized embedding or LM head ({name}, {tensor.dtype}) is "
                             "not supported")
        if tensor.shape[0] != self.vocab_size or tensor.shape[1] != self.weight.shape[1]:
            raise ValueError(f"shape mismatch: vocab {self.vocab_size} x {self.weight.shape[1]} "
                             f"vs checkpoint {tuple(tensor.shape)}")
        mine = tensor[self.start:self.start + self.rows]
        self.weight.data[:mine.shape[0]].copy_(mine)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits; may share its weight with the embedding (same sharding)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        logits = self.parallel.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[:, :self.vocab_size]
