"""A stand-in for the model workers that checks every step message it receives.

It keeps what a worker keeps, a KV pool of token slots and a block table per row, but
stores token ids in the slots; the "model" answers a deterministic function of the tokens it
reads back through the block table, so outputs depend on the scheduler having sent the right
tokens and blocks (a reused cached block must hold its prefix's tokens).
"""
from __future__ import annotations

from engine_actors.messages import StepInput


def next_token(seq: list[int]) -> int:
    """Depends on every token and its position (KV blocks in the wrong order are caught)."""
    h = len(seq)
    for t in seq:
        h = (h * 31 + t) % 1_000_003
    return h % 199


class FakeRunner:
    def __init__(self, block_size: int, model=next_token):
        self.block_size = block_size
        self.model = model  # tokens so far -> the next one
        self.slots: dict[int, int] = {}  # KV slot (block * block_size + offset) -> token
        self.tables: dict[int, dict[int, int]] = {}  # row -> col -> block
        self.last_sample: dict[int, int] = {}  # row -> token it sampled last (for -1 tokens)
        self.shift: dict[int, int] = {}  # row -> its last step's rejected draft tokens, negated
        self.steps: list[StepInput] = []

    def _slot(self, row: int, position: int) -> int:
        col, offset = divmod(position, self.block_size)
        assert col in self.tables[row], f"row {row}: no KV block for position {position}"
        return self.tables[row][col] * self.block_size + offset

    def execute(self, step: StepInput) -> list[int]:
        self.steps.append(step)
        for new in step.new_requests:
            self.tables[new.row] = {}
        for row, col, block in zip(step.table_rows, step.table_cols, step.table_blocks):
            self.tables[row][col] = block
        assert len(set(step.rows)) == len(step.rows), "a request twice in one step"
        out, offset = [], 0
        drafts = step.num_drafts or [0] * len(step.rows)
        for i, (row, ctx, n, sample, d) in enumerate(zip(step.rows, step.context_lens,
                                                         step.query_lens, step.sample, drafts)):
            new = step.token_ids[offset:offset + n]
            # a continuation (-1) is a decode's token, before its draft tokens if it has any
            assert all(t >= 0 for t in new[:n - d][:-1] + new[n - d:]), new
            new = [self.last_sample[row] if t < 0 else t for t in new]
            if i in step.shifted:  # placed as if its previous step's drafts were accepted
                assert step.token_ids[offset] < 0
                ctx += self.shift[row]
            for i, t in enumerate(new):
                self.slots[self._slot(row, ctx + i)] = t
            seq = []
            for p in range(ctx + n):
                slot = self._slot(row, p)
                assert slot in self.slots, f"row {row}: position {p} was never computed"
                seq.append(self.slots[slot])
            offset += n
            if sample:  # after its last token, and after each draft token's prefix
                samples = [self.model(seq[:len(seq) - d + j]) for j in range(d + 1)]
                out.extend(samples)
                accepted = 0  # as the worker does on the device for the next step
                while accepted < d and samples[accepted] == new[n - d + accepted]:
                    accepted += 1
                self.last_sample[row] = samples[accepted]
                self.shift[row] = accepted - d
        assert offset == len(step.token_ids)
        return out


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
    return out
