"""A stand-in for the model workers that checks every step message it receives.

It mirrors what a worker keeps (per-row token history and block table) and asserts the
scheduler's messages are consistent with it; the "model" answers a deterministic function
of the whole sequence, so outputs depend on the scheduler having sent the right tokens.
"""
from __future__ import annotations

from engine_actors.messages import StepInput


def next_token(seq: list[int]) -> int:
    return (sum(seq) * 31 + len(seq)) % 199


class FakeRunner:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seqs: dict[int, list[int]] = {}  # row -> tokens whose KV exists
        self.tables: dict[int, dict[int, int]] = {}  # row -> col -> block
        self.last_sample: dict[int, int] = {}  # row -> token it sampled last (for -1 tokens)
        self.steps: list[StepInput] = []

    def execute(self, step: StepInput) -> list[int]:
        self.steps.append(step)
        for new in step.new_requests:
            self.seqs[new.row] = []
            self.tables[new.row] = {}
        for row, col, block in zip(step.table_rows, step.table_cols, step.table_blocks):
            self.tables[row][col] = block
        assert len(set(step.rows)) == len(step.rows), "a request twice in one step"
        out, offset = [], 0
        for row, ctx, n, sample in zip(step.rows, step.context_lens, step.query_lens, step.sample):
            seq = self.seqs[row]
            assert ctx == len(seq), f"row {row}: context {ctx} but {len(seq)} tokens cached"
            new = step.token_ids[offset:offset + n]
            assert all(t >= 0 for t in new[:-1]), "only the last new token can be a continuation (-1)"
            seq.extend(self.last_sample[row] if t < 0 else t for t in new)
            offset += n
            needed = -(-len(seq) // self.block_size)
            assert all(c in self.tables[row] for c in range(needed)), "KV block missing"
            if sample:
                out.append(next_token(seq))
                self.last_sample[row] = out[-1]
        assert offset == len(step.token_ids)
        return out


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
    return out
