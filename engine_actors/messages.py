"""What crosses the scheduler -> worker boundary once per iteration: plain lists and ints.

A request's sampling settings travel once, when it is admitted (`NewRequest`); after that
it is named by its row in the workers' tables. Block ids travel as deltas.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class NewRequest:
    row: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    num_skip_draws: int = 0  # a recomputed seeded request resumes its random stream here


@dataclass(slots=True)
class StepInput:
    step_id: int = 0  # consecutive per worker group; workers run steps in this order
    new_requests: list[NewRequest] = field(default_factory=list)
    # one entry per scheduled request, in batch order
    rows: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # tokens already in the KV cache
    query_lens: list[int] = field(default_factory=list)  # new tokens this iteration
    sample: list[bool] = field(default_factory=list)  # False for a prompt chunk that is not the last
    # [T], all new tokens, flattened; -1 = the token this row's previous step samples
    token_ids: list[int] = field(default_factory=list)
    # block-table deltas: block_table[rows[k]][cols[k]] = blocks[k]
    table_rows: list[int] = field(default_factory=list)
    table_cols: list[int] = field(default_factory=list)
    table_blocks: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
