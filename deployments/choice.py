"""One choice of a request as its tokens arrive: its text (stop strings), token ids, log-
probabilities, tool calls and reasoning, and its finish reason."""
from __future__ import annotations

import dataclasses
import uuid

from deployments.logprobs import LogprobsWriter, PromptLogprobs
from deployments.reasoning import ReasoningStream, output_parser, reasoning_tokens
from deployments.tool_parsers import CALL_SEPARATORS, ToolCallStream, make_parser
from engine_actors.detokenizer import TextStream
from engine_actors.messages import EngineRequest, RequestUpdate


class Choice:
    """One choice's accumulated text, token counts, log-probabilities and finish reason."""

    def __init__(self, index: int, prompt_index: int, text_stream: TextStream,
                 prompt_ids: list[int], echo: str | None, timer=None, logprobs=None,
                 tools=None, reasoning=None, stop_token_ids: tuple[int, ...] = (),
                 stop_reason_ids: tuple[int, ...] = ()):
        self.index = index
        self.prompt_index = prompt_index
        self.text_stream = text_stream
        self.prompt_ids = prompt_ids
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0  # of the prompt, found in the engine's prefix cache
        self.token_ids: list[int] = []  # generated (return_token_ids)
        self.num_ids_sent = 0
        self.echo = echo
        self.text = echo or ""
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string, or the stop token (of stop_reason_ids: the
        # request's, and EOS ids other than the tokenizer's), that ended it
        self.stop_reason: str | int | None = None
        self.stop_reason_ids = stop_reason_ids
        self.error: str | None = None
        self.timer = timer  # deployments.http_metrics.RequestTimer, when measured
        self.logprobs = logprobs  # deployments.logprobs.LogprobsWriter, when asked
        self.num_prompt_entries = 0  # prompt tokens in self.logprobs (echo)
        self.tools = tools  # deployments.tool_parsers.ToolCallStream, with tools
        self.tool_calls: list = []  # parsed at the end
        self.call_ids: list[str] = []
        self.reasoning = reasoning  # deployments.reasoning.ReasoningStream, with a parser
        self.reasoning_text = ""
        self.new_reasoning = ""  # added by the last update (empty when not shown)
        self.shows_reasoning = True  # vLLM's include_reasoning
        self._num_reasoning_tokens: int | None = None  # kept once the reasoning ended
        self.stop_token_ids = stop_token_ids  # stop tokens and EOS: their text is not output
        self.prompt_logprobs = None  # deployments.logprobs.PromptLogprobs, when asked
        self.role = "assistant"  # of a chat answer (add_generation_prompt: false, as vLLM)
        self.echo_only = False  # a completion's echo with max_tokens 0: no generated token

    def consume(self, update: RequestUpdate,
                arrivals: list[tuple[float, int]] | None = None) -> str:
        """Apply one update; returns the new text. `arrivals`: when its tokens reached this
        replica, (time, count) pairs, if it merges several updates (RequestGroup)."""
        is_final = update.finish_reason is not None
        if self.echo_only:  # the one token computed is not part of the answer
            ended = update.finish_reason in ("length", "stop")
            update = dataclasses.replace(update, token_ids=[], num_output_tokens=0,
                                         logprobs=None, finish_reason="length" if ended
                                         else update.finish_reason)
            arrivals = None
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        if update.error and update.finish_reason != "deadline":
            self.error = update.error
        was_stopped = self.text_stream.is_stopped
        ids = update.token_ids
        delta = self.text_stream.add(ids, is_final, hide_last=update.finish_reason == "stop"
                                     and bool(ids) and ids[-1] in self.stop_token_ids)
        if not was_stopped:
            self.token_ids += update.token_ids
            del self.token_ids[self.text_stream.num_tokens_used:]  # after a stop string
        if self.reasoning is not None:  # the answer, less the reasoning, goes on
            self.new_reasoning, delta = self.reasoning.add(
                delta, is_final or self.text_stream.is_stopped)
            if not self.shows_reasoning:
                self.new_reasoning = ""
            self.reasoning_text += self.new_reasoning
        if self.tools is not None:  # what may be a tool call is held until it is parsed
            delta = self.tools.add(delta)
            if is_final or self.text_stream.is_stopped:
                rest, self.tool_calls = self.tools.finish()
                delta += rest or ""
                self.call_ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in self.tool_calls]
        self.text += delta
        if self.text_stream.is_stopped:
            self.finish_reason, self.stop_reason = "stop", self.text_stream.stop_string
        elif is_final:
            self.finish_reason = update.finish_reason
            if update.finish_reason == "stop" and ids and ids[-1] in self.stop_reason_ids:
                self.stop_reason = ids[-1]
        if self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        if self.logprobs is not None and not was_stopped:
            self._add_logprobs(update)
        if self.prompt_logprobs is not None and update.prompt_logprobs:
            self.prompt_logprobs.add(update.prompt_logprobs)
        if self.timer is not None and not was_stopped:
            for at, count in arrivals or [(None, len(update.token_ids))]:
                self.timer.tokens(count, at)
            if self.finish_reason is not None and not self.error:
                self.timer.done(self.finish_reason)
        return delta

    def _add_logprobs(self, update: RequestUpdate) -> None:
        if self.echo is not None and not self.logprobs.chat and (
                update.prompt_logprobs or update.token_ids or self.echo_only):
            if self.num_prompt_entries == 0:  # the first prompt token has none
                self.logprobs.entries.append((self.prompt_ids[0], None))
                self.num_prompt_entries = 1
            for lp, ids, values, rank in update.prompt_logprobs or ():
                k = self.logprobs.num_top  # the engine's may have more (for prompt_logprobs)
                self.logprobs.entries.append((self.prompt_ids[self.num_prompt_entries],
                                              (lp, ids[:k], values[:k], rank)))
                self.num_prompt_entries += 1
        if update.logprobs:
            self.logprobs.add(update.token_ids, update.logprobs)
        if self.text_stream.is_stopped:  # nothing after the stop string
            self.logprobs.cut(self.num_output_tokens, self.num_prompt_entries)

    def tool_call_deltas(self) -> list[dict]:
        return [{"index": i, **call.to_openai(call_id)}
                for i, (call, call_id) in enumerate(zip(self.tool_calls, self.call_ids))]

    def message(self) -> dict:
        out = {"role": self.role, "content": self.text}
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning_text or None
            if self.reasoning_text and not self.text:  # vLLM's: no answer is null
                out["content"] = None
        if self.tool_calls:
            out["content"] = self.text or None
            out["tool_calls"] = [call.to_openai(call_id)
                                 for call, call_id in zip(self.tool_calls, self.call_ids)]
        return out

    @property
    def num_reasoning_tokens(self) -> int:
        """Of the generated tokens, those of the reasoning (its tags included)."""
        if self.reasoning is None:
            return 0
        if self._num_reasoning_tokens is None or not self.reasoning.is_ended:
            self._num_reasoning_tokens = reasoning_tokens(self.text_stream.tokenizer,
                                                          self.token_ids, self.reasoning)
        return self._num_reasoning_tokens

    def take_token_ids(self) -> list[int]:
        """The generated token ids not streamed yet."""
        ids = self.token_ids[self.num_ids_sent:]
        self.num_ids_sent = len(self.token_ids)
        return ids

    def take_logprobs(self) -> dict | None:
        return self.logprobs.take() if self.logprobs is not None else None

    @property
    def num_output_tokens(self) -> int:
        return self.text_stream.num_tokens_used


def new_choice(frontend, req, index: int, text: str | None, ids: list[int], r: EngineRequest,
               chat: bool, timer, tool_parser: str | None,
               eos_token_ids: tuple[int, ...] = ()) -> Choice:
    """What turns one choice's tokens into its text: stop strings, echo, log-probabilities,
    tool calls and reasoning, as the request `req` asks (its engine request: `r`, its prompt
    `text` and `ids`). `frontend`: the replica's (tokenizer, config)."""
    tokenizer = frontend.tokenizer
    reasoning = output_parser(req, frontend.cfg.reasoning_parser) if chat else None
    include_stop = req.include_stop_str_in_output
    k = r.sampling.logprobs
    other_eos = tuple(set(eos_token_ids) - {tokenizer.eos_token_id})  # (vLLM's stop_reason)
    calls = ToolCallStream(make_parser(tool_parser, req.tools), req.max_tool_calls(),
                           CALL_SEPARATORS.get(tool_parser) if req.forces_tool_calls else None) \
        if tool_parser else None  # (max_tool_calls: as many as it may)
    # a format whose markers are special tokens keeps them in the text it parses
    skip_special = req.skip_special_tokens and not (calls and calls.parser.needs_special_tokens)
    choice = Choice(index, index // req.n,
                    TextStream(tokenizer, req.stop_list(), include_stop, skip_special),
                    ids, _echo_text(tokenizer, req, text, ids, chat), timer,
                    LogprobsWriter(tokenizer, chat, k, req.return_tokens_as_token_ids)
                    if k is not None else None, calls,
                    ReasoningStream(reasoning) if reasoning else None,
                    () if include_stop else r.sampling.stop_token_ids + eos_token_ids,
                    r.sampling.stop_token_ids + other_eos)
    if req.prompt_logprobs is not None:
        choice.prompt_logprobs = PromptLogprobs(tokenizer, ids, req.prompt_logprobs)
    if chat:
        choice.role = req.response_role()
        choice.shows_reasoning = req.include_reasoning
    else:
        choice.echo_only = req.echo_only
    return choice


def _echo_text(tokenizer, req, text: str | None, ids: list[int], chat: bool) -> str | None:
    """What the output starts with: a completion's prompt (echo), or a chat's last message
    if it has the answer's role (echo, as vLLM)."""
    if not req.echo:
        return None
    if chat:
        return req.echo_text()
    return text if text is not None else tokenizer.decode(ids)
