"""Building a step message, for the scheduler: one request's tokens and block-table deltas,
a newly admitted request's settings for the workers, and the log-probabilities a request
asked for (of its sampled tokens, and of its prompt positions, each delivered once even if
it is recomputed)."""
from __future__ import annotations

from engine_actors.messages import (NewRequest, ProcessorSettings, StepInput, StepResult,
                                    TokenLogprobs)
from engine_actors.request import Request

CONTINUE = -1  # "the token this row's previous step samples", resolved on the worker


def add_to_step(step: StepInput, req: Request, n: int, draft: list[int] | None = None) -> bool:
    """Append `req`'s next n tokens (from its computed ones on) to the step message: its
    row, context and query lengths, token ids (CONTINUE for the one being sampled now), its
    draft (None: no request of the step has one) and the block-table entries its workers'
    row lacks. True if the step samples its next token."""
    start = req.num_computed_tokens
    if req.num_inflight_samples and req.draft:
        step.shifted.append(len(step.rows))
    first_col = req.num_blocks_sent  # the workers' table row has blocks up to here
    new_blocks = req.blocks[first_col:]
    req.num_blocks_sent = len(req.blocks)
    step.table_rows.extend([req.row] * len(new_blocks))
    step.table_cols.extend(range(first_col, first_col + len(new_blocks)))
    step.table_blocks.extend(new_blocks)
    step.rows.append(req.row)
    step.context_lens.append(start)
    known = req.token_ids[start:start + n]
    step.token_ids.extend(known)
    step.token_ids.extend([CONTINUE] * (n - len(known)))
    sample = start + n == req.num_tokens + req.num_inflight_samples
    if draft is not None:
        step.token_ids.extend(draft)
        step.num_drafts.append(len(draft))
    step.query_lens.append(n + len(draft or ()))
    step.sample.append(sample)
    return sample


def new_request(req: Request, eos_token_ids: set[int]) -> NewRequest:
    s = req.sampling
    processors = None
    if s.has_processors:
        stops = tuple(eos_token_ids) + s.stop_token_ids if s.min_tokens else ()
        # bad words look back at most their longest prefix (a recomputed request's tokens)
        look_back = max(map(len, s.bad_words)) - 1 if s.bad_words else 0
        generated = req.token_ids[req.num_prompt_tokens:]
        processors = ProcessorSettings(
            req.num_prompt_tokens, s.presence_penalty, s.frequency_penalty,
            s.repetition_penalty, s.logit_bias, s.min_tokens, req.num_output_tokens, stops,
            s.allowed_token_ids, s.bad_words,
            tuple(generated[len(generated) - look_back:]) if look_back else (),
            s.thinking_budget, tuple(generated) if s.thinking_budget else ())
    return NewRequest(req.row, s.temperature, s.top_p, s.top_k, s.seed, s.min_p,
                      num_skip_draws=req.num_output_tokens, processors=processors,
                      logprobs=-1 if s.logprobs is None else s.logprobs, grammar=s.grammar,
                      replay_tokens=req.token_ids[req.num_prompt_tokens:] if s.grammar else [],
                      lora_slot=req.lora_slot)


def wants_prompt_logprobs(req: Request, start: int) -> bool:
    """Is the chunk at `start` one whose positions still lack their prompt log-probabilities
    (a request recomputed after preemption had them delivered already)?"""
    last = req.num_prompt_tokens - 1  # positions 0 .. last-1 have a next prompt token
    return (req.sampling.prompt_logprobs is not None and start < last
            and req.num_prompt_logprobs < last)


def trim(lps: TokenLogprobs, k: int) -> TokenLogprobs:
    """A step computes as many alternatives as its most demanding request: keep k."""
    lp, ids, values, rank = lps
    return lp, ids[:k], values[:k], rank


def new_prompt_logprobs(batch, result: StepResult) -> dict[int, list[TokenLogprobs]]:
    """Batch index -> the prompt log-probabilities of positions not delivered before."""
    found = {}
    for (index, k, _), start, lps in zip(batch.step.prompt_logprobs, batch.prompt_starts,
                                         result.prompt_logprobs or ()):
        req = batch.scheduled[index].request
        if req.num_preemptions != batch.epochs[index]:
            continue  # preempted since: its recomputation delivers them
        skip = max(0, req.num_prompt_logprobs - start)
        found[index] = [trim(x, k) for x in lps[skip:]]
        req.num_prompt_logprobs = max(req.num_prompt_logprobs, start + len(lps))
    return found
