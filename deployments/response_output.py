"""The Responses API's output: the `response` object of one request, and its stream of
typed events (the writer that openai_api's stream drives, as it drives SSEWriter).

A response's `output` holds a `reasoning` item (with a reasoning parser), a `message` item
(the text) and `function_call` items, in that order. Streamed, events numbered by
`sequence_number` build those items and end with the whole response
(`response.completed`, `response.incomplete`, or `response.failed`).
"""
from __future__ import annotations

import json
import time
import uuid

from deployments.protocol import APIError
from deployments.choice import Choice
from deployments.responses import usage
from deployments.responses_protocol import ResponsesRequest

# a choice's finish reason -> the response's status "incomplete" and its
# incomplete_details.reason: None when the server cut the request short ("abort": while
# draining), for which OpenAI's API has no reason
INCOMPLETE = {"length": "max_output_tokens", "abort": None}


class ResponseObject:
    """One request's `response` object: its id, the settings it echoes, and its output
    items built from the finished choice (with the ids the streamed events used)."""

    def __init__(self, req: ResponsesRequest, model: str, temperature: float, top_p: float,
                 cache_block_size: int | None = None, is_stored: bool = False):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.is_stored = is_stored
        self.cache_block_size = cache_block_size  # None: no prefix caching
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.settings = {
            "model": model, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": temperature,
            "top_p": top_p, "tools": req.echoed_tools(),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls, "text": req.echoed_text(),
            "max_tool_calls": req.max_tool_calls, "top_logprobs": req.top_logprobs or 0,
            "metadata": req.metadata or {}, "store": is_stored, "background": req.background,
            "previous_response_id": req.previous_response_id, "truncation": req.truncation,
            "conversation": {"id": req.conversation_id} if req.conversation_id else None,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "user": req.user}

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             error: dict | None = None, details: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": details,
                "output": output, "usage": usage, **self.settings}

    def final(self, choice: Choice) -> dict:
        """The response of a finished choice."""
        status = "incomplete" if choice.finish_reason in INCOMPLETE else "completed"
        output = [self.reasoning(choice, status)] if choice.reasoning_text else []
        if has_message(choice):
            output.append(self.message(choice.text, status, all_logprobs(choice)))
        output += self.calls(choice)
        details = {"reason": INCOMPLETE[choice.finish_reason]} if status == "incomplete" \
            else None
        return self.body(status, output, self.usage(choice), details=details)

    def usage(self, choice: Choice) -> dict:
        counts = usage({"": choice})
        details = counts["prompt_tokens_details"]
        # with prefix caching the engine keeps every full block of the prompt that it
        # computed (not found cached) for later requests: those tokens are written
        written = 0
        if self.cache_block_size:
            size = self.cache_block_size
            written = max(0, choice.num_prompt_tokens // size * size - details["cached_tokens"])
        return {"input_tokens": counts["prompt_tokens"],
                "input_tokens_details": {**details, "cache_write_tokens": written},
                "output_tokens": counts["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": choice.num_reasoning_tokens},
                "total_tokens": counts["total_tokens"]}

    def message(self, text: str, status: str, logprobs: list[dict] = ()) -> dict:
        content = [output_text(text, logprobs)] if status != "in_progress" else []
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}

    def reasoning(self, choice: Choice | None, status: str) -> dict:
        """The reasoning item (None: one just opened); complete once </think> came."""
        if choice is None:
            return {"type": "reasoning", "id": self.reasoning_id, "status": status,
                    "summary": [], "content": []}
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "status": "completed" if choice.reasoning.is_ended else status,
                "content": [reasoning_text(choice.reasoning_text)]}

    @staticmethod
    def calls(choice: Choice) -> list[dict]:
        return [{"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}",
                 "call_id": call_id, "name": call.name, "arguments": call.arguments,
                 "status": "completed"}
                for call, call_id in zip(choice.tool_calls, choice.call_ids)]


def has_message(choice: Choice) -> bool:
    """A finished choice has a message item if it has text, or nothing else."""
    return bool(choice.text) or not (choice.tool_calls or choice.reasoning_text)


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def output_text(text: str, logprobs: list[dict] = ()) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def all_logprobs(choice: Choice) -> list[dict]:
    """The log-probabilities (chat's entries) of the answer's tokens, if the request asked:
    every generated token's but the reasoning's."""
    if choice.logprobs is None:
        return []
    return choice.logprobs.result()["content"][choice.num_reasoning_tokens:]


def _taken(choice: Choice) -> list[dict]:
    """The log-probabilities of the answer's tokens since the last text delta (streamed
    with it): the reasoning's are left out."""
    if choice.logprobs is None:
        return []
    first = choice.logprobs.num_taken  # the index of the first entry taken now
    taken = choice.take_logprobs()
    skip = max(0, choice.num_reasoning_tokens - first)
    return taken["content"][skip:] if taken else []


class ResponseEvents:
    """The Responses stream of one request: the writer that openai_api's stream drives (as
    it drives SSEWriter), one choice. Reasoning opens its item at its first delta, and text
    the message item at its first (closing the reasoning: it comes first); tool calls
    arrive whole when the choice ends (deployments/tool_parsers.py holds them back), each
    an item with its arguments in one delta."""

    def __init__(self, response: ResponseObject, save=None, background: bool = False):
        self.response = response
        self.save = save  # an async function of the final response, to store it
        self.is_background = background  # (its run sends its state's events: state())
        self.final: dict | None = None  # the response as it ended, once it has
        self.num_events = 0  # the next sequence_number
        self.num_items = 0  # output items opened: the next one's output_index
        self.reasoning_index: int | None = None  # of the reasoning item, while open
        self.message_index: int | None = None  # of the message item, once open
        self.has_failed = False

    def _event(self, kind: str, **fields) -> dict:
        data = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        # ASCII-only JSON, as SSEWriter's: one event per line for every client
        return {"event": kind, "data": json.dumps(data)}

    def start(self, choices: dict[str, Choice]) -> list[dict]:
        if self.is_background:
            return []
        body = self.response.body("in_progress", [])
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def state(self, status: str) -> dict:
        """A background response's event as it is accepted ("queued": response.created)
        and as it starts ("in_progress")."""
        return self._event("response.created" if status == "queued" else
                           "response.in_progress", response=self.response.body(status, []))

    def update(self, choice: Choice, delta: str) -> list[dict]:
        events = []
        if choice.new_reasoning:
            events += self._open_reasoning()
            events.append(self._event("response.reasoning_text.delta", content_index=0,
                                      delta=choice.new_reasoning, **self._reasoning_ids()))
        if delta:
            events += self._close_reasoning(choice, "in_progress") + self._open_message()
            events.append(self._event("response.output_text.delta", content_index=0,
                                      delta=delta, logprobs=_taken(choice),
                                      **self._message_ids()))
        if choice.finish_reason in (None, "deadline"):  # a missed deadline is an error
            return events
        status = "incomplete" if choice.finish_reason in INCOMPLETE else "completed"
        events += self._close_reasoning(choice, status)
        if has_message(choice):
            events += self._open_message()
            logprobs = all_logprobs(choice)
            part = output_text(choice.text, logprobs)
            events += [self._event("response.output_text.done", content_index=0,
                                   text=choice.text, logprobs=logprobs, **self._message_ids()),
                       self._event("response.content_part.done", content_index=0, part=part,
                                   **self._message_ids()),
                       self._event("response.output_item.done", output_index=self.message_index,
                                   item=self.response.message(choice.text, status,
                                                              logprobs))]
        for call in self.response.calls(choice):
            ids = {"item_id": call["id"], "output_index": self.num_items}
            self.num_items += 1
            events += [self._event("response.output_item.added", output_index=ids["output_index"],
                                   item={**call, "arguments": "", "status": "in_progress"}),
                       self._event("response.function_call_arguments.delta", **ids,
                                   delta=call["arguments"]),
                       self._event("response.function_call_arguments.done", **ids,
                                   arguments=call["arguments"]),
                       self._event("response.output_item.done", output_index=ids["output_index"],
                                   item=call)]
        return events

    def _reasoning_ids(self) -> dict:
        return {"item_id": self.response.reasoning_id, "output_index": self.reasoning_index}

    def _message_ids(self) -> dict:
        return {"item_id": self.response.message_id, "output_index": self.message_index}

    def _open_reasoning(self) -> list[dict]:
        if self.reasoning_index is not None:
            return []
        self.reasoning_index, self.num_items = self.num_items, self.num_items + 1
        return [self._event("response.output_item.added", output_index=self.reasoning_index,
                            item=self.response.reasoning(None, "in_progress")),
                self._event("response.content_part.added", content_index=0,
                            part=reasoning_text(""), **self._reasoning_ids())]

    def _close_reasoning(self, choice: Choice, status: str) -> list[dict]:
        if self.reasoning_index is None:
            return []
        ids, text = self._reasoning_ids(), choice.reasoning_text
        self.reasoning_index = None
        return [self._event("response.reasoning_text.done", content_index=0, text=text, **ids),
                self._event("response.content_part.done", content_index=0,
                            part=reasoning_text(text), **ids),
                self._event("response.output_item.done", output_index=ids["output_index"],
                            item=self.response.reasoning(choice, status))]

    def _open_message(self) -> list[dict]:
        if self.message_index is not None:
            return []
        self.message_index, self.num_items = self.num_items, self.num_items + 1
        return [self._event("response.output_item.added", output_index=self.message_index,
                            item=self.response.message("", "in_progress")),
                self._event("response.content_part.added", content_index=0,
                            part=output_text(""), **self._message_ids())]

    async def finish(self, choices: dict[str, Choice]) -> list[dict]:
        if self.has_failed:
            return []
        body = self.final = self.response.final(next(iter(choices.values())))
        if self.save is not None:  # before the client sees the end, and may continue from it
            await self.save(body)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=body)]

    def error(self, message: str) -> dict:
        return self._failed(message)

    def error_event(self, error: APIError) -> dict:
        return self._failed(error.message)

    def _failed(self, message: str) -> dict:
        """OpenAI's codes of a failed response name no timeouts or missed deadlines: every
        failure here is a "server_error" whose message says what happened."""
        self.has_failed = True
        body = self.final = self.response.body("failed", [], error={"code": "server_error",
                                                                    "message": message})
        return self._event("response.failed", response=body)

    @staticmethod
    def done() -> list[dict]:
        return []  # the Responses stream has no [DONE]: its last event is the response
