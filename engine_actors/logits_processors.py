"""Logits processors and log-probabilities, on the device, for the rows that ask for them.

Per-row settings live in device tensors indexed by table row, written once at admission
(`NewRequest.processors`); the token counts the penalties need grow as the row's tokens go
through the model: `observe` sees every new token of a step (prompt or generated, by its
position), so a request recomputed after preemption rebuilds its counts from its tokens.
The [rows, vocab] tensors are allocated on first use. Host mirrors say which rows are
active, so a step without such rows costs nothing, and none of this reads the device.

Order, as vLLM's: raw logits -> (log-probabilities taken here) -> repetition penalty
(transformers' definition, over prompt and generated tokens) -> presence and frequency
penalties (OpenAI's, over generated tokens) -> logit bias -> min_tokens (EOS and stop
tokens masked) -> allowed_token_ids (every other token masked) -> bad words (bad_words.py)
-> the thinking budget (thinking_budget.py) -> temperature, min-p, top-k, top-p (sampler.py).
"""
from __future__ import annotations

import numpy as np
import torch

from engine_actors.bad_words import BadWords
from engine_actors.thinking_budget import ThinkingBudget
from engine_actors.messages import ProcessorSettings, StepInput, StepResult, TokenLogprobs
from engine_actors.transfer import Staging


class LogitsProcessors:
    def __init__(self, max_num_seqs: int, device: torch.device, staging: Staging):
        n = max_num_seqs + 1  # + the padding row of CUDA-graph batches
        self.device, self.staging = device, staging
        zeros = dict(device=device)
        self.prompt_len = torch.zeros(n, dtype=torch.long, **zeros)
        self.presence = torch.zeros(n, **zeros)
        self.frequency = torch.zeros(n, **zeros)
        self.repetition = torch.ones(n, **zeros)
        self.min_tokens = torch.zeros(n, dtype=torch.long, **zeros)
        self.generated = torch.zeros(n, dtype=torch.long, **zeros)
        self.bias_ids = torch.zeros(n, 0, dtype=torch.long, **zeros)
        self.bias = torch.zeros(n, 0, **zeros)
        self.stop_ids = torch.zeros(n, 0, dtype=torch.long, **zeros)
        self.is_counted = torch.zeros(n, dtype=torch.bool, **zeros)
        self.is_restricted = torch.zeros(n, dtype=torch.bool, **zeros)
        self.counts: torch.Tensor | None = None  # [rows, V] generated-token counts
        self.seen: torch.Tensor | None = None  # [rows, V] prompt tokens (repetition penalty)
        self.allowed: torch.Tensor | None = None  # [rows, V] allowed_token_ids, as a mask
        self.rows: set[int] = set()  # rows with any processor (host mirror)
        self.counted: set[int] = set()  # rows whose tokens are counted
        self.restricted: set[int] = set()  # rows with allowed_token_ids
        self.bad_words = BadWords(n, device, staging)
        self.thinking = ThinkingBudget(n, device, staging)

    def add(self, row: int, s: ProcessorSettings | None) -> None:
        """A request admitted at `row` (None: no processors)."""
        if row in self.rows:  # the row's previous request had processors: neutral again
            self.rows.discard(row)
            self.presence[row], self.frequency[row], self.repetition[row] = 0.0, 0.0, 1.0
            self.min_tokens[row] = 0
            self.bias_ids[row], self.bias[row], self.stop_ids[row] = -1, 0.0, -1
        if row in self.counted:
            self.counted.discard(row)
            self.is_counted[row] = False
        if row in self.restricted:
            self.restricted.discard(row)
            self.is_restricted[row] = False
        self.bad_words.add(row, s and s.bad_words, s.recent if s else ())
        self.thinking.add(row, s and s.thinking_budget, s.generated if s else ())
        if s is None:
            return
        if s.allowed_ids is not None:
            self._allow(row, s.allowed_ids)
        self.rows.add(row)
        self.prompt_len[row] = s.num_prompt_tokens
        self.presence[row], self.frequency[row] = s.presence_penalty, s.frequency_penalty
        self.repetition[row] = s.repetition_penalty
        self.min_tokens[row], self.generated[row] = s.min_tokens, s.num_generated
        self.bias_ids, self.bias = self._set_row(self.bias_ids, self.bias, row,
                                                 [i for i, _ in s.logit_bias],
                                                 [b for _, b in s.logit_bias])
        self.stop_ids, _ = self._set_row(self.stop_ids, None, row, list(s.stop_ids), None)
        if s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0:
            self.counted.add(row)
            self.is_counted[row] = True
            if self.counts is None:
                self.counts = torch.zeros(len(self.prompt_len), 0, dtype=torch.int32,
                                          device=self.device)
                self.seen = torch.zeros(len(self.prompt_len), 0, dtype=torch.bool,
                                        device=self.device)
            if self.counts.shape[1]:
                self.counts[row] = 0
                self.seen[row] = False

    def _allow(self, row: int, ids: tuple[int, ...]) -> None:
        self.restricted.add(row)
        self.is_restricted[row] = True
        if self.allowed is None:  # the width is the logits' (set on first use in apply)
            self.allowed = torch.zeros(len(self.prompt_len), max(ids) + 1, dtype=torch.bool,
                                       device=self.device)
        elif self.allowed.shape[1] <= max(ids):
            self.allowed = torch.cat([self.allowed, self.allowed.new_zeros(
                self.allowed.shape[0], max(ids) + 1 - self.allowed.shape[1])], 1)
        self.allowed[row] = False
        self.allowed[row, self.staging.to_device(np.asarray(ids, np.int64))] = True

    def _set_row(self, ids: torch.Tensor, values, row: int, new_ids: list, new_values):
        """Write one row of a padded [rows, K] table, widening it when needed; padding is
        id -1 (masked where the table is used)."""
        if len(new_ids) > ids.shape[1]:
            grow = len(new_ids) - ids.shape[1]
            ids = torch.cat([ids, torch.full((ids.shape[0], grow), -1, dtype=ids.dtype,
                                             device=ids.device)], 1)
            if values is not None:
                values = torch.cat([values, values.new_zeros(values.shape[0], grow)], 1)
        ids[row] = -1
        if new_ids:  # through the pinned staging buffers: no host sync
            ids[row, :len(new_ids)] = self.staging.to_device(np.asarray(new_ids, np.int64))
        if values is not None:
            values[row] = 0.0
            if new_values:
                values[row, :len(new_values)] = self.staging.to_device(
                    np.asarray(new_values, np.float32))
        return ids, values

    def observe(self, token_rows: list[int] | None, rows_t: torch.Tensor,
                positions: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        """Count the step's tokens of counted rows: generated ones (position >= prompt
        length) for the penalties, prompt ones in `seen`. token_rows: the step's rows on
        the host (to skip the work when none is counted); tensors [T] on the device."""
        if not self.counted or not self.counted.intersection(token_rows):
            return
        if self.counts.shape[1] != vocab_size:
            self.counts = torch.zeros(self.counts.shape[0], vocab_size, dtype=torch.int32,
                                      device=self.device)
            self.seen = torch.zeros_like(self.counts, dtype=torch.bool)
        rows = rows_t.long()
        ids = token_ids.long()
        mask = self.is_counted[rows]
        generated = mask & (positions.long() >= self.prompt_len[rows])
        self.counts.index_put_((rows, ids), generated.to(torch.int32), accumulate=True)
        self.seen.index_put_((rows, ids), mask & ~generated, accumulate=True)

    def apply(self, logits: torch.Tensor, rows_host: list[int],
              rows: torch.Tensor) -> torch.Tensor:
        """logits [N, V] fp32 of the sampling rows -> processed logits (new tensor)."""
        if not self.rows.intersection(rows_host):
            return logits
        rows = rows.long()
        logits = logits.clone()
        if self.counted.intersection(rows_host):
            counts = self.counts[rows].float()  # [N, V]
            seen = self.seen[rows] | (counts > 0)
            penalty = self.repetition[rows][:, None]
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
            logits -= self.frequency[rows][:, None] * counts
            logits -= self.presence[rows][:, None] * (counts > 0).float()
        if self.bias.shape[1]:
            ids = self.bias_ids[rows]
            logits.scatter_add_(1, ids.clamp(min=0), torch.where(ids >= 0, self.bias[rows], 0.0))
        if self.stop_ids.shape[1]:
            ids = self.stop_ids[rows]
            early = (self.generated[rows] < self.min_tokens[rows])[:, None] & (ids >= 0)
            masked = torch.where(early, float("-inf"), 0.0)
            logits.scatter_add_(1, ids.clamp(min=0), masked)
        if self.restricted.intersection(rows_host):
            vocab = logits.shape[1]
            if self.allowed.shape[1] < vocab:
                self.allowed = torch.cat([self.allowed, self.allowed.new_zeros(
                    self.allowed.shape[0], vocab - self.allowed.shape[1])], 1)
            allowed = self.allowed[rows, :vocab] | ~self.is_restricted[rows][:, None]
            logits = logits.masked_fill(~allowed, float("-inf"))
        logits = self.bad_words.apply(logits, rows_host, rows)
        return self.thinking.apply(logits, rows_host, rows, self.generated)

    def sampled(self, rows_host: list[int], rows: torch.Tensor, ids: torch.Tensor) -> None:
        """The sampling rows produced one token each, `ids` (min_tokens counts them, bad
        words look back at them)."""
        if self.rows.intersection(rows_host):
            rows = rows.long()
            self.thinking.sampled(rows_host, rows, ids, self.generated[rows])
            self.generated[rows] += 1
            self.bad_words.sampled(rows_host, rows, ids)


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int,
                 rank: bool = False) -> torch.Tensor:
    """[N, V] raw logits, [N] chosen ids -> [N, 3 + 2k] float32: the chosen token's id,
    log-probability and, if `rank`, its rank (1 + how many other tokens are at least as
    likely, as vLLM counts it; else 0), then the k most likely tokens' ids and
    log-probabilities (ids and ranks are exact in float32 up to 2^24). Only prompt_logprobs
    show ranks: for sampled tokens the pass over the vocabulary is skipped."""
    if logits.shape[0] == 0:
        return logits.new_zeros(0, 3 + 2 * k, dtype=torch.float32)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long()[:, None])  # [N, 1]
    rank = (logprobs >= chosen).sum(dim=1, keepdim=True).clamp(min=1).float() if rank \
        else torch.zeros_like(chosen)  # [N, 1]
    top = logprobs.topk(k, dim=-1) if k else None
    parts = [token_ids.float()[:, None], chosen, rank]
    if top is not None:
        parts += [top.indices.float(), top.values]
    return torch.cat(parts, dim=1)


def unpack_logprobs(row: list[float], k: int) -> TokenLogprobs:
    """One row of top_logprobs (on the host) -> (chosen lp, top ids, top lps, chosen rank).
    -inf and NaN (a checkpoint's broken logits) become -9999.0, as vLLM shows -inf: JSON
    has neither."""
    return (_finite(row[1]), [int(i) for i in row[3:3 + k]],
            [_finite(v) for v in row[3 + k:3 + 2 * k]], int(row[2]))


def _finite(value: float) -> float:
    return value if value >= -9999.0 else -9999.0  # NaN compares false


def prompt_positions(step: StepInput, cu_seqlens_q) -> tuple[list[int], list[int], list[int]]:
    """The flattened positions whose prompt log-probabilities the step asks for: every
    position of the chunk that has a next prompt token (the next input token, or the
    chunk's successor for its last position); (positions, next tokens, count per entry)."""
    positions, targets, counts = [], [], []
    for b, _, next_token in step.prompt_logprobs:
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        last = end if next_token >= 0 else end - 1
        positions += range(start, last)
        targets += step.token_ids[start + 1:end] + ([next_token] if next_token >= 0 else [])
        counts.append(last - start)
    return positions, targets, counts


def stack(sampled, packed, k: int, prompt: torch.Tensor, kp: int) -> torch.Tensor:
    """The sampled rows' packing (or just their ids) and the prompt positions', in one
    [N + M, 3 + 2 max(k, kp)] float32 tensor (narrower rows padded with zeros)."""
    n = sampled.shape[0]
    out = torch.zeros(n + prompt.shape[0], 3 + 2 * max(k, kp), device=sampled.device)
    if packed is not None:
        out[:n, :packed.shape[1]] = packed
    else:
        out[:n, 0] = sampled.float()
    out[n:, :prompt.shape[1]] = prompt
    return out


def ids_only(values: list[int]) -> StepResult:
    return StepResult(values)


def unpack(values: list[list[float]], num_sample: int, k: int, kp: int,
            prompt_counts: list[int]) -> StepResult:
    """The packed rows on the host -> token ids and log-probabilities (see stack)."""
    ids = [int(row[0]) for row in values[:num_sample]]
    logprobs = [unpack_logprobs(row, k) for row in values[:num_sample]] if k >= 0 else None
    prompt, i = [], num_sample
    for count in prompt_counts:
        prompt.append([unpack_logprobs(row, kp) for row in values[i:i + count]])
        i += count
    return StepResult(ids, logprobs, prompt if kp >= 0 else None)
