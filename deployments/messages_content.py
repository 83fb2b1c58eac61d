"""The content of Anthropic's Messages API as chat messages: each message's blocks, checked
one at a time so that an error names its place (`messages.2.content.0`), become chat
messages (a user's `tool_result` blocks tool messages, an assistant's `tool_use` blocks its
tool calls and `thinking` blocks its reasoning); text blocks are joined one per line.
An image in a tool's result becomes a line saying it was left out (a client such as
Claude Code keeps it in every later request); Claude Code's billing header (a system
block that changes with every request) is dropped, so that prefix caching works.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from deployments.chat_protocol import ChatMessage, ContentPart, FunctionCall, ToolCallMessage
from deployments.protocol import APIError, _Base
from deployments.responses_items import need_object, validate


class MessageParam(_Base):
    role: Literal["user", "assistant", "system"]
    content: str | list[Any]  # blocks: checked one at a time


class TextBlock(_Base):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Base):
    """A call the model made earlier (an assistant's block, sent back)."""
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Base):
    """The result of a call, for the model to read."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Any] = ""
    is_error: bool = False


class ThinkingBlock(_Base):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


BILLING_HEADER = "x-anthropic-billing-header"  # (Claude Code's attribution, per request)
# what an image in a tool's result becomes
IMAGE_LEFT_OUT = {"type": "text", "text": "[image left out: this model reads text only]"}


def system_first(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The messages with every system message merged into one at the start (for chat
    templates that refuse a system message elsewhere, as vLLM merges them); None when
    there is nothing to merge."""
    systems = [m for m in messages if m.role == "system"]
    if not any(m.role == "system" for m in messages[1:]):
        return None
    merged = ChatMessage(role="system", content="\n\n".join(m.text() for m in systems))
    return [merged] + [m for m in messages if m.role != "system"]


def chat_messages(m: MessageParam, i: int) -> list[ChatMessage]:
    """One Messages message -> chat messages: a user's tool results are tool messages
    (before its text), an assistant's tool uses its tool calls and thinking its reasoning."""
    param = f"messages.{i}.content"
    if isinstance(m.content, str) or m.role == "system":
        return [ChatMessage(role=m.role, content=text_of(m.content, param, m.role == "system"))]
    out, texts, calls, thinking = [], [], [], []
    for j, block in enumerate(m.content):
        need_object(block, f"{param}.{j}")
        kind, where = block.get("type"), f"{param}.{j}"
        if kind == "text":
            texts.append(ContentPart(type="text", text=validate(TextBlock, block, where).text))
        elif kind == "tool_result" and m.role == "user":
            result = validate(ToolResultBlock, block, where)
            text = _result_text(result.content, f"{where}.content")
            out.append(ChatMessage(role="tool", tool_call_id=result.tool_use_id,
                                   content=f"Error: {text}" if result.is_error else text))
        elif kind == "tool_use" and m.role == "assistant":
            use = validate(ToolUseBlock, block, where)
            calls.append(ToolCallMessage(id=use.id, function=FunctionCall(
                name=use.name, arguments=json.dumps(use.input, ensure_ascii=False))))
        elif kind == "thinking" and m.role == "assistant":
            thinking.append(validate(ThinkingBlock, block, where).thinking)
        elif kind == "redacted_thinking" and m.role == "assistant":
            continue  # (Anthropic's encrypted reasoning: nothing a template can show)
        else:
            raise APIError(400, f"content blocks of type {kind!r} are not supported in "
                                f"{m.role} messages: this server serves text-only models "
                                "and runs no server tools", f"{where}.type",
                           "unsupported_content")
    if m.role == "assistant":
        return [ChatMessage(role="assistant", content=texts, tool_calls=calls or None,
                            reasoning="".join(thinking) if thinking else None)]
    return out + ([ChatMessage(role="user", content=texts)] if texts or not out else [])


def text_of(content: str | list, param: str, system: bool = False) -> str:
    """A string, or text blocks joined (a system's as vLLM joins them, with nothing
    between; without Claude Code's billing header)."""
    if isinstance(content, str):
        return _without_billing(content) if system else content
    texts = []
    for j, block in enumerate(content):
        need_object(block, f"{param}.{j}")
        if block.get("type") != "text":
            raise APIError(400, f"content blocks of type {block.get('type')!r} are not "
                                "supported here: only text", f"{param}.{j}.type",
                           "unsupported_content")
        texts.append(validate(TextBlock, block, f"{param}.{j}").text)
    return "".join(map(_without_billing, texts)) if system else "\n".join(texts)


def _result_text(content: str | list, param: str) -> str:
    """A tool result's text: its text blocks one per line, an image a line saying so."""
    if isinstance(content, list):
        content = [IMAGE_LEFT_OUT if isinstance(block, dict) and block.get("type") == "image"
                   else block for block in content]
    return text_of(content, param)



def _without_billing(text: str) -> str:
    """A system text without Claude Code's billing header line (its first, when there)."""
    if not text.startswith(BILLING_HEADER):
        return text
    return text.partition("\n")[2]
