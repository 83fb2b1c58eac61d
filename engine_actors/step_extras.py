"""What a step carries besides tokens, for the scheduler: a newly admitted request's
settings for the workers, and the log-probabilities a request asked for (of its sampled
tokens, and of its prompt positions, each delivered once even if it is recomputed)."""
from __future__ import annotations

from engine_actors.messages import NewRequest, ProcessorSettings, StepResult, TokenLogprobs
from engine_actors.request import Request


def new_request(req: Request, eos_token_ids: set[int]) -> NewRequest:
    s = req.sampling
    processors = None
    if s.has_processors:
        stops = tuple(eos_token_ids) + s.stop_token_ids if s.min_tokens else ()
        processors = ProcessorSettings(
            req.num_prompt_tokens, s.presence_penalty, s.frequency_penalty,
            s.repetition_penalty, s.logit_bias, s.min_tokens, req.num_output_tokens, stops)
    return NewRequest(req.row, s.temperature, s.top_p, s.top_k, s.seed, req.num_output_tokens,
                      processors, -1 if s.logprobs is None else s.logprobs, s.grammar,
                      req.token_ids[req.num_prompt_tokens:] if s.grammar else [])


def wants_prompt_logprobs(req: Request, start: int) -> bool:
    """Is the chunk at `start` one whose positions still lack their prompt log-probabilities
    (a request recomputed after preemption had them delivered already)?"""
    last = req.num_prompt_tokens - 1  # positions 0 .. last-1 have a next prompt token
    return (req.sampling.prompt_logprobs is not None and start < last
            and req.num_prompt_logprobs < last)


def trim(lps: TokenLogprobs, k: int) -> TokenLogprobs:
    """A step computes as many alternatives as its most demanding request: keep k."""
    lp, ids, values = lps
    return lp, ids[:k], values[:k]


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
