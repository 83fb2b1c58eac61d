"""Sampling on the device: greedy, temperature, min-p, top-k, top-p, per-request seeds.

Per-request settings live in tensors indexed by table row, written once at admission, so a
step needs no per-request host work. Random rows sample with the exponential-race trick,
argmax(p / E) with E ~ Exp(1), which draws exactly from p. A seeded request draws E from
its own generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import numpy as np
import torch

from engine_actors.grammar import apply_bitmask
from engine_actors.logits_processors import LogitsProcessors, top_logprobs
from engine_actors.messages import NO_TOKEN, NewRequest
from engine_actors.transfer import Staging


class Sampler:
    def __init__(self, max_num_seqs: int, device: torch.device, seed: int,
                 staging: Staging | None = None):
        self.device = device
        self.staging = staging or Staging(device)
        self.processors = LogitsProcessors(max_num_seqs, device, self.staging)
        self.num_logprobs = [-1] * (max_num_seqs + 1)  # per row: alternatives wanted, or -1
        self.temperature = torch.zeros(max_num_seqs, device=device)
        self.top_p = torch.ones(max_num_seqs, device=device)
        self.top_k = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.min_p = torch.zeros(max_num_seqs, device=device)
        # host mirrors decide the fast paths without reading the device
        self.is_greedy = [True] * max_num_seqs
        self.is_truncated = [False] * max_num_seqs  # top-k or top-p active
        self.has_min_p = [False] * max_num_seqs
        self.generators: dict[int, torch.Generator] = {}  # row -> generator of a seeded request
        # row -> draws to replay before its next one: a seeded request recomputed after
        # preemption resumes its random stream where it was. Replayed at sampling time, on a
        # row of the real logits, so every draw has the shape the original draws had.
        self.skips: dict[int, int] = {}
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def add(self, reqs: list[NewRequest]) -> None:
        if not reqs:
            return
        values = np.array([(r.row, r.temperature, r.top_p, r.top_k, r.min_p) for r in reqs],
                          dtype=np.float64).T.copy()
        rows, temperature, top_p, top_k, min_p = self.staging.to_device(values)
        rows = rows.long()
        self.temperature[rows] = temperature.float()
        self.top_p[rows] = top_p.float()
        self.top_k[rows] = top_k.long()
        self.min_p[rows] = min_p.float()
        for r in reqs:
            self.processors.add(r.row, r.processors)
            self.num_logprobs[r.row] = r.logprobs
            self.is_greedy[r.row] = r.temperature == 0.0
            self.is_truncated[r.row] = r.top_k > 0 or r.top_p < 1.0
            self.has_min_p[r.row] = r.min_p > 0.0
            self.generators.pop(r.row, None)
            self.skips.pop(r.row, None)
            if r.seed is not None and r.temperature > 0.0:
                g = torch.Generator(device=self.device)
                g.manual_seed(r.seed)
                self.generators[r.row] = g
                self.skips[r.row] = r.num_skip_draws

    def sample(self, logits: torch.Tensor, rows: list[int], idx: torch.Tensor,
               grammar_mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Raw logits [N, V] fp32 -> (token ids [N], their log-probabilities packed by
        top_logprobs or None, the number of alternatives k in the packing). grammar_mask:
        [N, V/32] allowed-token bits on the device (structured output)."""
        processed = self.processors.apply(logits, rows, idx)
        if grammar_mask is not None:
            processed = apply_bitmask(processed, grammar_mask)
        ids = self(processed, rows, idx)
        k = min(max((self.num_logprobs[r] for r in rows), default=-1), logits.shape[-1])
        packed = top_logprobs(logits, ids, k) if k >= 0 else None
        if processed is not logits:  # a row its masks left no token: NO_TOKEN, not token 0
            ids = torch.where(processed.amax(dim=-1) == float("-inf"), NO_TOKEN, ids)
            if packed is not None:
                packed[:, 0] = ids.float()
        self.processors.sampled(rows, idx, ids)
        return ids, packed, k

    def __call__(self, logits: torch.Tensor, rows: list[int], idx: torch.Tensor) -> torch.Tensor:
        """logits [N, V] fp32 for the N sampling rows (`rows` on the host, `idx` on the
        device) -> token ids [N]."""
        greedy = logits.argmax(dim=-1)
        if all(self.is_greedy[r] for r in rows):
            return greedy
        idx = idx.long()
        temperature = self.temperature[idx]
        logits = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if any(self.has_min_p[r] for r in rows):  # as vLLM: after temperature, before top-k/p
            probs = torch.softmax(logits, dim=-1)
            floor = self.min_p[idx][:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if any(self.is_truncated[r] for r in rows):
            logits = self._truncate(logits, self.top_k[idx], self.top_p[idx])
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            g = self.generators.get(row)
            if g is not None:
                for _ in range(self.skips.pop(row, 0) + 1):  # one draw per sampled token
                    noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature == 0.0, greedy, sampled)

    @staticmethod
    def _truncate(logits, top_k, top_p):
        """Keep each row's top-k tokens, then the smallest nucleus of those with mass >= top-p.

        The best token always stays, so no row is left empty.
        """
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
