"""Input items of the Responses API: checked one at a time (an error names its place,
`input.2.content.0`), stored in one shape whatever form they came in, each with an id of
its own (stored_responses.py keeps them), and turned into chat messages."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import ValidationError

from deployments.chat_protocol import ChatMessage, FunctionCall, ToolCallMessage
from deployments.protocol import APIError, _Base
from deployments.request_body import validation_error

TEXT_PARTS = ("input_text", "output_text")


class TextPart(_Base):
    type: str  # one of the kinds _text takes
    text: str


class MessageItem(_Base):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Any]


class FunctionCallItem(_Base):
    """A call the model made earlier (its output item, sent back)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON


class FunctionCallOutputItem(_Base):
    """The result of a call, for the model to read."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Any]


class ReasoningItem(_Base):
    """A model's earlier reasoning (its output item, sent back): its text is in `content`
    (reasoning_text parts), or only in `summary` (summary_text parts)."""
    type: Literal["reasoning"]
    summary: list[Any] = []
    content: list[Any] | None = None


class ItemReference(_Base):
    """An item of a stored response (input or output), by its id."""
    type: Literal["item_reference"]
    id: str


def normalize_input(items: str | list) -> list[dict]:
    """The request's `input` as stored items, each checked (an error names its index) and
    given a new id (new_id): message items with their text in content parts,
    function_call, function_call_output and reasoning items; item_reference items are left
    for the caller to resolve."""
    if isinstance(items, str):
        return [_message_item("user", [{"type": "input_text", "text": items}])]
    out = []
    for i, item in enumerate(items):
        need_object(item, f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            msg = validate(MessageItem, item, f"input.{i}")
            text = _text(msg.content, f"input.{i}.content")
            part = {"type": "output_text", "text": text, "annotations": []} \
                if msg.role == "assistant" else {"type": "input_text", "text": text}
            out.append(_message_item(msg.role, [part]))
        elif kind == "function_call":
            call = validate(FunctionCallItem, item, f"input.{i}")
            out.append({**call.model_dump(), "id": new_id("fc"), "status": "completed"})
        elif kind == "function_call_output":
            result = validate(FunctionCallOutputItem, item, f"input.{i}")
            out.append({"type": kind, "id": new_id("fco"), "call_id": result.call_id,
                        "output": _text(result.output, f"input.{i}.output"),
                        "status": "completed"})
        elif kind == "reasoning":
            reasoning = validate(ReasoningItem, item, f"input.{i}")
            parts, param, part_type = (reasoning.content, "content", "reasoning_text") \
                if reasoning.content else (reasoning.summary, "summary", "summary_text")
            text = _text(parts, f"input.{i}.{param}", (part_type,))
            out.append({"type": kind, "id": new_id("rs"), "summary": [], "status": "completed",
                        "content": [{"type": "reasoning_text", "text": text}]})
        elif kind == "item_reference":
            out.append(validate(ItemReference, item, f"input.{i}").model_dump())
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported (this server "
                                "takes message, function_call, function_call_output and "
                                "item_reference items)", f"input.{i}.type", "unsupported_item")
    return out


def _message_item(role: str, content: list[dict]) -> dict:
    return {"type": "message", "id": new_id("msg"), "role": role, "content": content,
            "status": "completed"}


def new_id(prefix: str) -> str:
    """An input item's id. The ids items came with are not kept: a client sends back the
    items of earlier responses with their ids, and an id must name one stored item."""
    return f"{prefix}_{uuid.uuid4().hex}"


def item_messages(items: list[dict]) -> list[ChatMessage]:
    """Stored items (normalize_input's, and output items) -> chat messages. Consecutive
    function calls (and the assistant text before them) are one assistant turn, as the
    model produced them."""
    messages: list[ChatMessage] = []
    reasoning = None  # an assistant turn's reasoning, which comes before its text or calls
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = "".join(part["text"] for part in item["content"])
            continue
        if kind == "message":
            messages.append(ChatMessage(role=item["role"], content="".join(
                part["text"] for part in item["content"])))
        elif kind == "function_call":
            call = ToolCallMessage(id=item["call_id"], function=FunctionCall(
                name=item["name"], arguments=item["arguments"]))
            if messages and messages[-1].role == "assistant" and reasoning is None:
                messages[-1].tool_calls = (messages[-1].tool_calls or []) + [call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", tool_call_id=item["call_id"],
                                        content=item["output"]))
        if reasoning is not None and messages[-1].role == "assistant":
            messages[-1].reasoning = reasoning
        reasoning = None
    return messages


def _text(content: str | list, param: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A message's text: a string, or its text parts (of these `kinds`) joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        need_object(part, f"{param}.{j}")
        if part.get("type") not in kinds:
            raise APIError(400, f"content parts of type {part.get('type')!r} are not "
                                "supported: this server serves text-only models",
                           f"{param}.{j}", "unsupported_content")
        texts.append(validate(TextPart, part, f"{param}.{j}").text)
    return "".join(texts)


def need_object(value, param: str) -> None:
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be an object", param, "invalid_value")


def validate(schema: type[_Base], data: dict, param: str):
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, param) from None
