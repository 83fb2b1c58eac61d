"""vLLM's thinking_token_budget on the device: once a reasoning model has thought for this
many tokens, its next token is the end of thinking (</think>: every other token is
masked), and the answer follows.

A row thinks from its first token (`start` is -1: DeepSeek-R1's templates end the prompt in
<think>), or only if its first token is <think> (Qwen3, whose template leaves thinking to
the model); the </think> token ends it. The budget counts the tokens after <think>, as
vLLM's. A request admitted again after preemption starts in the state its generated tokens
left it in.
"""
from __future__ import annotations

import numpy as np
import torch


class ThinkingBudget:
    def __init__(self, num_rows: int, device: torch.device, staging):
        self.staging = staging
        self.start = torch.full((num_rows,), -1, dtype=torch.long, device=device)
        self.end = torch.full((num_rows,), -1, dtype=torch.long, device=device)
        self.budget = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.is_thinking = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.rows: set[int] = set()  # rows with a budget (host mirror)

    def add(self, row: int, budget: tuple[int, int, int] | None,
            generated: tuple[int, ...] = ()) -> None:
        """A request admitted at `row`: its (<think> id or -1, </think> id, budget), or
        None, and the tokens it generated so far (a recomputed request's)."""
        if budget is None and row not in self.rows:
            return
        self.rows.discard(row)  # (a row whose request had a budget is reset)
        start, end, limit = budget or (-1, -1, 0)
        thinking = budget is not None and (
            (not generated and start < 0) or (bool(generated) and end not in generated
                                              and (start < 0 or generated[0] == start)))
        limit += start >= 0  # (counted after <think>, as vLLM counts)
        values = self.staging.to_device(np.asarray([start, end, limit, thinking], np.int64))
        self.start[row], self.end[row], self.budget[row] = values[0], values[1], values[2]
        self.is_thinking[row] = values[3].bool()
        if budget is not None:
            self.rows.add(row)

    def apply(self, logits: torch.Tensor, rows_host: list[int], rows: torch.Tensor,
              generated: torch.Tensor) -> torch.Tensor:
        """Rows over their budget while thinking may only write </think>. `generated`:
        [rows] tokens each table row generated so far."""
        if not self.rows.intersection(rows_host):
            return logits
        over = self.is_thinking[rows] & (generated[rows] >= self.budget[rows])  # [N]
        only_end = torch.zeros_like(logits, dtype=torch.bool)
        only_end.scatter_(1, self.end[rows].clamp(min=0)[:, None], True)
        return logits.masked_fill(over[:, None] & ~only_end, float("-inf"))

    def sampled(self, rows_host: list[int], rows: torch.Tensor, ids: torch.Tensor,
                generated: torch.Tensor) -> None:
        """The rows sampled `ids`, their tokens number `generated` + 1 (before this one:
        `generated`): a first token decides whether a row thinks, </think> ends it."""
        if not self.rows.intersection(rows_host):
            return
        start = self.start[rows]
        decides = (generated == 0) & (start >= 0)
        thinking = torch.where(decides, ids == start, self.is_thinking[rows])
        self.is_thinking[rows] = thinking & (ids != self.end[rows])
