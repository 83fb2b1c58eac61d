"""The Responses API's request schema, and its conversion into a chat completion request.

A Responses request is a chat request in other clothes: `input` items become chat
messages (`instructions` a system message first, a `function_call` an assistant tool call,
a `function_call_output` a tool message), `tools` and `tool_choice` lose a level of nesting,
`text.format` is `response_format`. The chat route's machinery then serves it as it is.
Items, tools and content parts are checked one at a time, so that an error names its
place (`input.2.content.0`), and stored (stored_responses.py) with an id each, in one
shape whatever form they came in. `conversation` (the Conversations API) and `background`
are refused.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from deployments.chat_protocol import (ChatCompletionRequest, ChatMessage, FunctionCall,
                                       FunctionDefinition, NamedFunction, NamedToolChoice,
                                       Tool, ToolCallMessage)
from deployments.protocol import (APIError, JSONSchemaSpec, ResponseFormat, SamplingOptions,
                                  _Base, validation_error)

TEXT_PARTS = ("input_text", "output_text")
# the chat request's params, as a Responses request names them (in error objects)
RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                    "response_format": "text.format"}


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


class FunctionTool(_Base):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Base):
    format: TextFormat | None = None


class ResponsesRequest(SamplingOptions):
    model: str | None = None
    input: str | list[Any]  # the items are checked in to_chat, each naming its index
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # checked in to_chat
    parallel_tool_calls: bool = True
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool = False
    prompt: Any = None  # a stored prompt template: refused
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    # extensions, as on the chat route
    chat_template_kwargs: dict | None = None
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None

    def check_supported(self) -> None:
        if self.conversation is not None:
            raise APIError(400, "conversation is not supported: this server has no "
                                "Conversations API; continue with previous_response_id, or "
                                "send the whole conversation as input", "conversation",
                           "unsupported_parameter")
        if self.background:
            raise APIError(400, "background responses are not supported: this server "
                                "answers while it generates", "background",
                           "unsupported_parameter")
        if self.prompt is not None:
            raise APIError(400, "prompt (a stored prompt template) is not supported: this "
                                "server stores none; send the text as input", "prompt",
                           "unsupported_parameter")
        if self.truncation == "auto":
            raise APIError(400, "truncation \"auto\" is not supported: an input over the "
                                "context length is refused, never cut", "truncation",
                           "unsupported_parameter")

    @property
    def wants_logprobs(self) -> bool:
        """OpenAI's include names them; top_logprobs over 0 asks for them too."""
        return bool(self.top_logprobs) or "message.output_text.logprobs" in (self.include or [])

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            _need_object(tool, f"tools.{i}")
            if tool.get("type") != "function":
                raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: "
                                    "this server runs function tools only",
                               f"tools.{i}.type", "unsupported_tool")
            tools.append(_validate(FunctionTool, tool, f"tools.{i}"))
        return tools

    def to_chat(self, items: list[dict]) -> ChatCompletionRequest:
        """The equivalent chat completion request of the conversation `items` (stored
        items: those of earlier responses, then this request's input, its references
        resolved); APIError(400) naming the offending Responses param."""
        messages = [] if self.instructions is None else \
            [ChatMessage(role="system", content=self.instructions)]
        messages += item_messages(items)
        if len(messages) == 0:
            raise APIError(400, "input must not be empty", "input", "invalid_value")
        tools = [Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in self.function_tools()]
        chat = ChatCompletionRequest(
            messages=messages, max_tokens=self.max_output_tokens, tools=tools or None,
            tool_choice=self._tool_choice(), parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(), model=self.model, stream=self.stream,
            priority=self.priority, timeout_s=self.timeout_s, user=self.user,
            logprobs=self.wants_logprobs, top_logprobs=self.top_logprobs,
            chat_template_kwargs=self.chat_template_kwargs,
            **self.model_dump(include=set(SamplingOptions.model_fields)))
        chat._call_limit = self.max_tool_calls
        chat.check_supported()
        return chat

    def _tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and \
                isinstance(choice.get("name"), str):
            return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"name\": ...}", "tool_choice",
                       "invalid_value")

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return ResponseFormat(type=fmt.type) if fmt is not None else None
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema is required with type json_schema",
                           "text.format.schema", "missing_required_parameter")
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaSpec(
            name=fmt.name or "response", schema=fmt.schema_, strict=fmt.strict,
            description=fmt.description))

    def echoed_tools(self) -> list[dict]:
        return [t.model_dump() for t in self.function_tools()]

    def echoed_text(self) -> dict:
        fmt = self.text.format if self.text is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None else {"type": "text"}}


def normalize_input(items: str | list) -> list[dict]:
    """The request's `input` as stored items, each checked (an error names its index) and
    given a new id (new_id): message items with their text in content parts,
    function_call, function_call_output and reasoning items; item_reference items are left
    for the caller to resolve."""
    if isinstance(items, str):
        return [_message_item("user", [{"type": "input_text", "text": items}])]
    out = []
    for i, item in enumerate(items):
        _need_object(item, f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            msg = _validate(MessageItem, item, f"input.{i}")
            text = _text(msg.content, f"input.{i}.content")
            part = {"type": "output_text", "text": text, "annotations": []} \
                if msg.role == "assistant" else {"type": "input_text", "text": text}
            out.append(_message_item(msg.role, [part]))
        elif kind == "function_call":
            call = _validate(FunctionCallItem, item, f"input.{i}")
            out.append({**call.model_dump(), "id": new_id("fc"), "status": "completed"})
        elif kind == "function_call_output":
            result = _validate(FunctionCallOutputItem, item, f"input.{i}")
            out.append({"type": kind, "id": new_id("fco"), "call_id": result.call_id,
                        "output": _text(result.output, f"input.{i}.output"),
                        "status": "completed"})
        elif kind == "reasoning":
            reasoning = _validate(ReasoningItem, item, f"input.{i}")
            parts, param, part_type = (reasoning.content, "content", "reasoning_text") \
                if reasoning.content else (reasoning.summary, "summary", "summary_text")
            text = _text(parts, f"input.{i}.{param}", (part_type,))
            out.append({"type": kind, "id": new_id("rs"), "summary": [], "status": "completed",
                        "content": [{"type": "reasoning_text", "text": text}]})
        elif kind == "item_reference":
            out.append(_validate(ItemReference, item, f"input.{i}").model_dump())
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
        _need_object(part, f"{param}.{j}")
        if part.get("type") not in kinds:
            raise APIError(400, f"content parts of type {part.get('type')!r} are not "
                                "supported: this server serves text-only models",
                           f"{param}.{j}", "unsupported_content")
        texts.append(_validate(TextPart, part, f"{param}.{j}").text)
    return "".join(texts)


def _need_object(value, param: str) -> None:
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be an object", param, "invalid_value")


def _validate(schema: type[_Base], data: dict, param: str):
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, param) from None
