"""Anthropic's Messages API output: the `message` object of one request, its stream of
events (the writer that openai_api's stream drives, as it drives SSEWriter), and its error
objects.

A message's `content` holds a `thinking` block (with a reasoning parser), a `text` block
and `tool_use` blocks, in that order; at least one block (an empty text block, as vLLM's,
for clients that read the first). Streamed: `message_start`, then each block opened,
filled by deltas and closed (`content_block_start`, `_delta`, `_stop`), then
`message_delta` (the stop reason and usage) and `message_stop`.
"""
from __future__ import annotations

import json
import uuid

from starlette.responses import JSONResponse

from deployments.choice import Choice
from deployments.protocol import APIError

# an HTTP status -> Anthropic's error type (its SDKs dispatch on it)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message), status_code=e.status,
                        headers=e.headers)


class MessageObject:
    """One request's `message` object: its id, and its content, stop reason and usage
    built from the finished choice."""

    def __init__(self, model: str, cache_block_size: int | None = None,
                 max_tokens: int | None = None):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.cache_block_size = cache_block_size  # None: no prefix caching
        self.max_tokens = max_tokens  # as asked (the engine's may be cut to the context)

    def body(self, content: list[dict], stop: tuple[str | None, str | None],
             usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}

    def final(self, choice: Choice) -> dict:
        content = [thinking_block(choice.reasoning_text)] if choice.reasoning_text else []
        if choice.text:
            content.append(text_block(choice.text))
        content += tool_blocks(choice)
        return self.body(content or [text_block("")], self.stop_reason(choice),
                         self.usage(choice))

    def stop_reason(self, choice: Choice) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence): None when the server cut the request short (while
        draining), for which Anthropic's API has no reason."""
        reason = choice.finish_reason
        if reason == "stop" and isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        if reason == "length" and self.max_tokens and \
                choice.num_output_tokens < self.max_tokens:  # (max_tokens cut to the context)
            return "model_context_window_exceeded", None
        return {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}.get(
            reason), None

    def usage(self, choice: Choice | None, prompt_tokens: int = 0) -> dict:
        """Anthropic's split of the prompt: tokens read from the prefix cache, tokens
        written to it (with prefix caching the engine keeps every full block it computed),
        and the rest (`input_tokens`). None: a message just started (no output yet)."""
        if choice is None:
            return {"input_tokens": prompt_tokens, "output_tokens": 0,
                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        prompt, cached = choice.num_prompt_tokens, choice.num_cached_tokens
        written = 0
        if self.cache_block_size:
            size = self.cache_block_size
            written = max(0, prompt // size * size - cached)
        return {"input_tokens": prompt - cached - written,
                "output_tokens": choice.num_output_tokens,
                "cache_creation_input_tokens": written, "cache_read_input_tokens": cached}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}  # (nothing to sign)


def tool_blocks(choice: Choice) -> list[dict]:
    return [{"type": "tool_use", "id": f"toolu_{call_id.removeprefix('call_')}",
             "name": call.name, "input": json.loads(call.arguments)}
            for call, call_id in zip(choice.tool_calls, choice.call_ids)]


class MessageEvents:
    """The Messages stream of one request: the writer that openai_api's stream drives (as
    it drives SSEWriter), one choice. Thinking opens its block at its first delta, and text
    its block at its first (closing the thinking: it comes first); tool calls arrive whole
    when the choice ends (deployments/tool_parsers.py holds them back), each a block with
    its input in one delta."""

    def __init__(self, message: MessageObject):
        self.message = message
        self.num_blocks = 0  # blocks opened: the next one's index
        self.open: str | None = None  # the type of the block now open
        self.has_failed = False

    @staticmethod
    def _event(kind: str, **fields) -> dict:
        # ASCII-only JSON, as SSEWriter's: one event per line for every client
        return {"event": kind, "data": json.dumps({"type": kind, **fields})}

    def start(self, choices: dict[str, Choice]) -> list[dict]:
        choice = next(iter(choices.values()))
        body = self.message.body([], (None, None),
                                 self.message.usage(None, choice.num_prompt_tokens))
        return [self._event("message_start", message=body)]

    def update(self, choice: Choice, delta: str) -> list[dict]:
        events = []
        if choice.new_reasoning:
            events += self._open("thinking", thinking_block(""))
            events.append(self._delta(type="thinking_delta", thinking=choice.new_reasoning))
        if delta:
            events += self._open("text", text_block(""))
            events.append(self._delta(type="text_delta", text=delta))
        if choice.finish_reason in (None, "deadline"):  # a missed deadline is an error
            return events
        events += self._close()
        for block in tool_blocks(choice):
            events += self._open("tool_use", {**block, "input": {}})
            events.append(self._delta(type="input_json_delta",
                                      partial_json=json.dumps(block["input"])))
            events += self._close()
        if self.num_blocks == 0:  # nothing came: one empty text block
            events += self._open("text", text_block("")) + self._close()
        return events

    def _delta(self, **delta) -> dict:
        return self._event("content_block_delta", index=self.num_blocks - 1, delta=delta)

    def _open(self, kind: str, block: dict) -> list[dict]:
        if self.open == kind:
            return []
        events = self._close()
        self.open, self.num_blocks = kind, self.num_blocks + 1
        return events + [self._event("content_block_start", index=self.num_blocks - 1,
                                     content_block=block)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.num_blocks - 1)]

    async def finish(self, choices: dict[str, Choice]) -> list[dict]:
        if self.has_failed:
            return []
        choice = next(iter(choices.values()))
        reason, sequence = self.message.stop_reason(choice)
        return [self._event("message_delta",
                            delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage=self.message.usage(choice)),
                self._event("message_stop")]

    def error(self, message: str) -> dict:
        return self.error_event(APIError(500, message))  # (an engine failure: api_error)

    def error_event(self, error: APIError) -> dict:
        self.has_failed = True
        return {"event": "error", "data": json.dumps(error_body(error.status, error.message))}

    @staticmethod
    def done() -> list[dict]:
        return []  # the Messages stream ends with message_stop (or an error event)
