"""Response bodies of the OpenAI routes: JSON completions and server-sent event streams."""
from __future__ import annotations

import json
import time
from typing import Protocol

from ray.exceptions import TaskCancelledError
from sse_starlette.sse import EventSourceResponse

from deployments.choice import Choice
from deployments.protocol import APIError, SamplingFields


# OpenAI's client retries a 408 by itself; it would only run out of time again
NO_RETRY = {"x-should-retry": "false"}


def timeout_error(timeout_s: float | None) -> APIError:
    return APIError(408, f"the request did not finish within {timeout_s:g} s", "timeout_s",
                    "timeout", "timeout_error", headers=NO_RETRY)


def deadline_error(deadline_ms: float | None) -> APIError:
    return APIError(408, f"the request's deadline ({deadline_ms:g} ms after arrival) passed "
                         "before it could start", "deadline_ms", "deadline_exceeded",
                    "timeout_error", headers=NO_RETRY)


class SSEResponse(EventSourceResponse):
    """Server-sent events (sse-starlette: each item of `content` is one event's data; keep-
    alive comments; the body generator is cancelled when the client leaves). `on_close`
    runs however the response ends, even when the client leaves before the body starts,
    so the stream's requests are always aborted."""

    def add_on_close(self, fn) -> None:
        """Also call fn() as the response closes, after what was given."""
        first = self._on_close

        def both():
            first()
            fn()
        self._on_close = both

    def __init__(self, content, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache"}, sep="\n")
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        async def receive_or_disconnect():
            # Serve's receive() is a Ray call: when the client leaves, Serve cancels it
            try:
                return await receive()
            except TaskCancelledError:
                return {"type": "http.disconnect"}

        try:
            await super().__call__(scope, receive_or_disconnect, send)
        except TaskCancelledError:  # the client left while an event was being sent
            pass
        finally:
            self._on_close()

    async def _send_with_timeout(self, send, message) -> None:
        # sse-starlette wraps every event's send in a timer scope, even with no send
        # timeout (ours): one event per token, so the scope was ~8% of a streaming
        # replica's CPU (BENCHMARKS.md). Without a timeout there is nothing to time.
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def usage(choices: dict[str, Choice]) -> dict:
    per_prompt = {c.prompt_index: c.num_prompt_tokens for c in choices.values()}
    cached: dict[int, int] = {}  # per prompt: its choices may have found different amounts
    for c in choices.values():
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.num_cached_tokens)
    prompt_tokens = sum(per_prompt.values())
    completion = sum(c.num_output_tokens for c in choices.values())
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
    if any(c.reasoning is not None for c in choices.values()):  # chat, a reasoning parser
        out["completion_tokens_details"] = {
            "reasoning_tokens": sum(c.num_reasoning_tokens for c in choices.values())}
    return out


def response_body(base_id: str, model: str, chat: bool, choices: dict[str, Choice],
                  token_ids: bool = False) -> dict:
    ordered = sorted(choices.values(), key=lambda c: c.index)
    def logprobs(c: Choice):
        return c.logprobs.result() if c.logprobs is not None else None

    if chat:
        items = [{"index": c.index, "message": c.message(), "logprobs": logprobs(c),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                 for c in ordered]
    else:
        items = [{"index": c.index, "text": c.text, "logprobs": logprobs(c),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                 for c in ordered]
        for item, c in zip(items, ordered):
            if c.prompt_logprobs is not None:  # vLLM's, per choice on completions
                item["prompt_logprobs"] = c.prompt_logprobs.result()
    if token_ids:  # (per choice on chat too; vLLM's place is the top level, below)
        for item, c in zip(items, ordered):
            item["prompt_token_ids"], item["token_ids"] = c.prompt_ids, c.token_ids
    body = {"id": base_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": items,
            "usage": usage(choices)}
    if chat and ordered[0].prompt_logprobs is not None:  # one prompt: once, as vLLM
        body["prompt_logprobs"] = ordered[0].prompt_logprobs.result()
    if chat and token_ids:
        body["prompt_token_ids"] = ordered[0].prompt_ids
    return body


class StreamWriter(Protocol):
    """What openai_api's stream hands its events to: SSEWriter (completions and chat
    completions) or response_output.ResponseEvents (the Responses API). Each method returns
    the events to send (an event: a string of data, or a dict of sse-starlette fields)."""

    def start(self, choices: dict[str, Choice]) -> list: ...

    def update(self, choice: Choice, delta: str) -> list:
        """After each update of a choice, with the text it added."""
        ...

    async def finish(self, choices: dict[str, Choice]) -> list:
        """At the normal end, every choice finished."""
        ...

    def error(self, message: str): ...

    def error_event(self, error: APIError): ...

    def done(self) -> list:
        """Last, however the stream ended."""
        ...


class SSEWriter:
    """Server-sent events in the streaming format of completions and chat completions."""

    def __init__(self, base_id: str, model: str, chat: bool, req: SamplingFields):
        self.base_id, self.model, self.chat = base_id, model, chat
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's: every chunk has its choice's usage so far (only with include_usage)
        self.continuous_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self.return_token_ids = req.return_token_ids
        self._sent_prompt_ids: set[int] = set()  # choices whose prompt ids went out
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, choices: list, usage: dict | None = None, **fields) -> str:
        body = {"id": self.base_id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **fields}
        if self.include_usage:
            body["usage"] = usage
        # ASCII-only JSON: U+2028, NEL and the like stay escaped, so clients that split lines
        # on every Unicode line break (many do) still see one event per line
        return json.dumps(body)

    def chunk(self, choice: Choice, text: str, finish_reason: str | None, role: bool = False,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None,
              token_ids: list[int] | None = None, reasoning: str = "") -> str:
        index = choice.index
        if self.chat:
            delta = {"role": choice.role, "content": text} if role else (
                {"content": text} if text else {})
            if reasoning:
                delta["reasoning"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            item = {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        else:
            item = {"index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        if finish_reason is not None:
            item["stop_reason"] = choice.stop_reason
        fields = {}
        if self.return_token_ids:
            item["token_ids"] = token_ids or []
            if index not in self._sent_prompt_ids:  # vLLM's: the prompt's, with the first
                self._sent_prompt_ids.add(index)  # chunk (a chat's: once, at the top level)
                if not self.chat:
                    item["prompt_token_ids"] = choice.prompt_ids
                elif not self._sent_prompt_ids - {index}:
                    fields["prompt_token_ids"] = choice.prompt_ids
        return self._event([item], usage({"": choice}) if self.continuous_usage else None,
                           **fields)

    def usage(self, usage: dict) -> str:
        return self._event([], usage)

    def start(self, choices: dict[str, Choice]) -> list[str]:
        """The role chunks (chat), then the echoed text (a completion's prompt, a chat's
        last message)."""
        roles = [self.chunk(c, "", None, role=True) for c in choices.values()] \
            if self.chat else []
        return roles + [self.chunk(c, c.echo, None) for c in choices.values() if c.echo]

    def update(self, choice: Choice, delta: str) -> list[str]:
        """The chunks for a choice's update: its new reasoning and text, at the end its
        tool calls (a chunk of their own) and its finish reason."""
        events = []
        reasoning = choice.new_reasoning
        if choice.tool_calls and choice.finish_reason:
            events.append(self.chunk(choice, delta, None,
                                     tool_calls=choice.tool_call_deltas(),
                                     logprobs=choice.take_logprobs(),
                                     token_ids=choice.take_token_ids(), reasoning=reasoning))
            delta = reasoning = ""
        if delta or reasoning or choice.finish_reason:
            events.append(self.chunk(choice, delta, choice.finish_reason,
                                     logprobs=choice.take_logprobs(),
                                     token_ids=choice.take_token_ids(), reasoning=reasoning))
        return events

    async def finish(self, choices: dict[str, Choice]) -> list[str]:
        return [self.usage(usage(choices))] if self.include_usage else []

    @staticmethod
    def error(message: str) -> str:
        return SSEWriter.error_event(APIError(503, message, err_type="service_unavailable"))

    @staticmethod
    def error_event(error: APIError) -> str:
        return json.dumps(error.body())

    @staticmethod
    def done() -> list[str]:
        return ["[DONE]"]
