"""vLLM's beam search (`use_beam_search: true`): each prompt's `n` likeliest continuations
under the model, instead of `n` samples.

It runs in the ingress replica, as vLLM's does. Every step, each live beam goes to the engine
as a request for one token that returns the 2n likeliest next tokens of the model's own
distribution. Of all the beams' extensions, the n with the highest cumulative
log-probability live on; one that picks EOS ends there (unless `ignore_eos`). After
max_tokens steps, or when no beam is left, the ended and live beams are ranked by cumulative
log-probability / (tokens generated, EOS counted) ** length_penalty, and the best n are the
choices, best first; a choice's tokens leave its EOS out (`include_stop_str_in_output` keeps
it), as vLLM's. The prefix cache spares each step the beam's earlier tokens, all but those of
its last partial block. Only the first step is subject to admission control: the later ones
continue an admitted request (no queue limit or drain refuses them).

`BeamSearch` is read as the route reads a RequestGroup (openai_api.py): when a prompt's
search ends, one RequestUpdate for each of its choices, with all of that choice's tokens
(and with `logprobs`, each token's log-probability and alternatives from its step).
"""
from __future__ import annotations

import asyncio
import dataclasses

from deployments.protocol import APIError
from deployments.request_group import EngineUnavailable
from engine_actors.messages import EngineRequest, RequestUpdate
from engine_actors.request import MAX_LOGPROBS, SamplingParams

MAX_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2n log-probabilities
# what beam search cannot follow -> the value that changes nothing (a sampling field such as
# temperature or top_p has no effect on it, as in vLLM)
UNFOLLOWED = {"stop": None, "stop_token_ids": None, "min_tokens": 0, "logit_bias": None,
              "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
              "bad_words": None, "allowed_token_ids": None, "prompt_logprobs": None,
              "deadline_ms": None, "thinking_token_budget": None}


def check(req, grammar) -> None:
    """APIError 400 naming the first field of `req` that beam search cannot follow."""
    for name, neutral in UNFOLLOWED.items():
        value = getattr(req, name, None)
        if not (value is None or value is False or value in ([], {})
                or (type(value) is type(neutral) and value == neutral)):
            raise APIError(400, f"{name} cannot be combined with use_beam_search", name,
                           "unsupported_parameter")
    if grammar is not None:
        raise APIError(400, "structured output and forced tool calls cannot be combined with "
                            "use_beam_search", "use_beam_search", "unsupported_parameter")
    if req.logprob_fields().get("prompt_logprobs") is not None:  # (the prompt's, for echo)
        raise APIError(400, "echo with logprobs cannot be combined with use_beam_search",
                       "echo", "unsupported_parameter")
    if req.n > MAX_WIDTH:
        raise APIError(400, f"use_beam_search takes at most n={MAX_WIDTH} beams", "n",
                       "invalid_value")


@dataclasses.dataclass
class Beam:
    tokens: list[int]  # generated, the EOS it ended with included
    logprob: float = 0.0  # cumulative
    finish_reason: str = "length"
    logprobs: list = dataclasses.field(default_factory=list)  # per token, when asked


class BeamSearch:
    """The beam searches of one request's prompts. `prompts`: (choice id prefix, prompt ids,
    max_tokens); each prompt's choices are "{prefix}-{j}", j = 0 (best) to n - 1."""

    def __init__(self, client, prompts: list[tuple[str, list[int], int]], width: int,
                 eos_ids: tuple[int, ...], ignore_eos: bool, include_stop: bool,
                 length_penalty: float, priority: int, adapter: str | None,
                 logprobs: int | None = None, cache_salt: str | None = None):
        """`logprobs`: each output token's log-probability and this many alternatives."""
        self.cache_salt = cache_salt or ""
        self.client, self.prompts, self.width, self.num_top = client, prompts, width, logprobs
        self.eos, self.ignore_eos, self.include_stop = set(eos_ids), ignore_eos, include_stop
        self.length_penalty, self.priority, self.adapter = length_penalty, priority, adapter
        self.unfinished = {f"{prefix}-{j}" for prefix, _, _ in prompts for j in range(width)}
        self.arrivals: dict = {}  # (as RequestGroup's: the route pops from it)
        self._done: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._groups: set = set()  # the steps in flight (closed with the search)
        self.search_id = f"{prompts[0][0]}-search"  # (a drain waits for it: close ends it)

    async def start(self) -> None:
        """Submit every prompt's first step (RequestRefused or EngineUnavailable, with
        nothing left queued, if the engine refuses any of them), then search on in tasks.
        Later steps continue an admitted request: no queue limit or drain refuses them."""
        try:
            firsts = await asyncio.gather(*(self._step(prefix, 0, ids, [Beam([])])
                                            for prefix, ids, _ in self.prompts),
                                          return_exceptions=True)
        except BaseException:  # cancelled (the client left): the route never closes it
            self.close()
            raise
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            self.close()
            raise failed
        self._tasks = [asyncio.ensure_future(self._search(*prompt, first))
                       for prompt, first in zip(self.prompts, firsts)]

    async def _step(self, prefix: str, step: int, ids: list[int], beams: list[Beam]):
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                  logprobs=max(2 * self.width, self.num_top or 0))
        group = await self.client.submit(
            [EngineRequest(f"{prefix}-s{step}-{i}", ids + b.tokens, sampling, self.priority,
                           None, self.adapter, continues=step > 0, search=self.search_id,
                           cache_salt=self.cache_salt)
             for i, b in enumerate(beams)], wake_each_update=False)
        self._groups.add(group)
        return group

    async def _tops(self, group, num_beams: int) -> list[tuple[list[int], list[float]]]:
        """Each beam's likeliest next tokens and their log-probabilities."""
        tops = {}
        try:
            async for rid, update in group:
                if update.error or not update.logprobs:
                    raise RuntimeError(update.error or "a beam's step ended without tokens")
                _, ids, values, _ = update.logprobs[0]
                tops[int(rid.rsplit("-", 1)[1])] = (ids, values)
        finally:
            group.close()
            self._groups.discard(group)
        return [tops[i] for i in range(num_beams)]

    async def _search(self, prefix: str, ids: list[int], max_tokens: int, group) -> None:
        try:
            best = await self._best(prefix, ids, max_tokens, group)
        except EngineUnavailable as e:
            self._done.put_nowait((None, e))
            return
        except Exception as e:  # a failed step: the prompt's choices fail
            best = [RequestUpdate(finish_reason="abort", error=f"beam search: {e}")] * self.width
        for j, update in enumerate(best):
            self._done.put_nowait((f"{prefix}-{j}", update))

    async def _best(self, prefix: str, ids: list[int], max_tokens: int, group
                    ) -> list[RequestUpdate]:
        beams, ended = [Beam([])], []  # ended: the n best that picked EOS
        for step in range(max_tokens):
            if step:
                group = await self._step(prefix, step, ids, beams)
            grown = []  # (cumulative logprob, beam, token, its logprobs): a Beam for n only
            for beam, (tokens, values) in zip(beams, await self._tops(group, len(beams))):
                for token, value in zip(tokens[:2 * self.width], values):
                    k = self.num_top  # (its own logprob, its alternatives; no rank)
                    lps = [] if k is None else [(value, tokens[:k], values[:k], 0)]
                    if token in self.eos and not self.ignore_eos:
                        ended.append(Beam(beam.tokens + [token], beam.logprob + value, "stop",
                                          beam.logprobs + lps))
                    else:
                        grown.append((beam.logprob + value, beam, token, lps))
            ended = sorted(ended, key=self._score, reverse=True)[:self.width]  # (fixed scores)
            grown.sort(key=lambda c: c[0], reverse=True)
            beams = [Beam(beam.tokens + [token], total, "length", beam.logprobs + lps)
                     for total, beam, token, lps in grown[:self.width]]
            if not beams:
                break
        best = sorted(ended + beams, key=self._score, reverse=True)
        if len(best) < self.width:
            raise RuntimeError(f"only {len(best)} beams for n={self.width}")
        updates = []
        for beam in best[:self.width]:  # EOS is not output, as vLLM's beam search
            n = len(beam.tokens) - (beam.finish_reason == "stop" and not self.include_stop)
            updates.append(RequestUpdate(
                token_ids=beam.tokens[:n], finish_reason=beam.finish_reason,
                num_prompt_tokens=len(ids), num_output_tokens=n,
                logprobs=beam.logprobs[:n] if self.num_top is not None else None))
        return updates

    def _score(self, beam: Beam) -> float:
        return beam.logprob / max(len(beam.tokens), 1) ** self.length_penalty

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[str, RequestUpdate]:
        if not self.unfinished:
            raise StopAsyncIteration
        rid, update = await self._done.get()
        if isinstance(update, BaseException):
            raise update
        self.unfinished.discard(rid)
        return rid, update

    def finish(self, request_id: str) -> None:
        self.unfinished.discard(request_id)

    def close(self) -> None:
        """End the searches (the client left, or the time ran out): abort their steps."""
        for task in self._tasks:
            task.cancel()
        for group in list(self._groups):
            group.close()
        self._groups.clear()
        self.unfinished.clear()
        self.client.end_search(self.search_id)
