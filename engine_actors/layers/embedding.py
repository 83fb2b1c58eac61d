from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        if tensor.shape != self.weight.shape:
            raise ValueError(f"shape mismatch: {tuple(self.weight.shape)} vs {tuple(tensor.shape)}")
        self.weight.data.copy_(tensor)


class LMHead(Embedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        return F.linear(hidden, self.weight)
