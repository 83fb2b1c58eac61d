"""The end of a step on the sampling (last) stage: grammar masks, logits processors,
sampling, log-probabilities, and the one tensor that goes back to the host."""
from __future__ import annotations

import functools

import torch

from engine_actors.grammar import Grammars, advance
from engine_actors.logits_processors import stack, top_logprobs, unpack
from engine_actors.messages import NewRequest, StepInput, StepResult
from engine_actors.sampler import Sampler
from engine_actors.speculative import accept_on_device
from engine_actors.transfer import PendingStep, Staging


class SamplingHead:
    def __init__(self, sampler: Sampler, grammars: Grammars, staging: Staging):
        self.sampler, self.grammars, self.staging = sampler, grammars, staging
        self.last_pending: PendingStep | None = None  # with grammars: results in step order

    def add(self, reqs: list[NewRequest], is_last_stage: bool) -> None:
        """Rows admitted by a step: their sampling settings, processors and grammars."""
        self.sampler.add(reqs)
        if is_last_stage:
            for r in reqs:
                self.grammars.add(r.row, r.grammar, r.replay_tokens)

    def sample(self, logits: torch.Tensor, inputs, step: StepInput, last_sampled: torch.Tensor,
               shift: torch.Tensor) -> tuple[torch.Tensor, object]:
        """logits [N + M, V]: the N sampling rows, then the M prompt positions whose
        log-probabilities are asked. Returns what to copy to the host and how to read it
        there (None: the token ids as they are). last_sampled, shift: what the next step
        continues from (speculative.accept_on_device)."""
        rows, num_sample = inputs.sample_rows_host, len(inputs.sample_rows_host)
        matchers, mask = self._grammar_mask(rows)
        sampled, packed, k = self.sampler.sample(logits[:num_sample], rows, inputs.sample_rows,
                                                 mask)
        if step.num_drafts:
            accept_on_device(sampled, inputs, last_sampled, shift)
        else:  # NO_TOKEN ends its request: a step already in flight reads a valid id meanwhile
            last_sampled[inputs.sample_rows] = sampled.clamp(min=0).to(torch.int32)
        out, parse, kp = sampled, None, -1
        if step.prompt_logprobs:
            kp = min(max(k for _, k, _ in step.prompt_logprobs), logits.shape[-1])
            prompt = top_logprobs(logits[num_sample:], inputs.prompt_targets, kp, rank=True)
            packed = stack(sampled, packed, k, prompt, kp)
        if packed is not None:  # ids and log-probabilities in one copy to the host
            out = packed
            parse = functools.partial(unpack, num_sample=num_sample, k=k, kp=kp,
                                      prompt_counts=inputs.prompt_counts)
        if matchers is not None:  # the tokens, once on the host, advance the matchers
            parse = functools.partial(_then_advance, parse or StepResult, matchers)
        return out, parse

    def launched(self, pending: PendingStep) -> None:
        if self.grammars.matchers:  # results read in step order (see PendingStep.before)
            pending.before, self.last_pending = self.last_pending, pending

    def _grammar_mask(self, rows: list[int]):
        """(matchers of the sampling rows, their token bitmask on the device), or (None,
        None) when no row samples under a grammar. The earlier steps' tokens are read first
        (the previous step may still run): the bitmask follows them. It is filled on the CPU
        while the device runs this step's forward."""
        matchers = self.grammars.active(rows) if self.grammars.matchers else None
        if not matchers or all(m is None for m in matchers):
            return None, None
        if self.last_pending is not None:
            self.last_pending.result()
        mask = self.grammars.bitmask(matchers)
        return matchers, None if mask is None else self.staging.to_device(mask.numpy())


def _then_advance(parse, matchers, values) -> StepResult:
    return advance(matchers, parse(values))
