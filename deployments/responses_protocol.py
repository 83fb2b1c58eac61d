"""The Responses API's request schema, and its conversion into a chat completion request.

A Responses request is a chat request in other clothes: `input` items become chat
messages (`instructions` a system message first, a `function_call` an assistant tool call,
a `function_call_output` a tool message), `tools` and `tool_choice` lose a level of nesting,
`text.format` is `response_format`. The chat route's machinery then serves it as it is.
Items (responses_items.py) and tools are checked one at a time, so that an error names
its place (`input.2.content.0`, `tools.1.type`). `conversation` (the Conversations API)
is refused; `background` needs `store` (background_responses.py).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from deployments.chat_protocol import (ChatCompletionRequest, ChatMessage,
                                       FunctionDefinition, NamedFunction, NamedToolChoice,
                                       ReasoningEffort, Tool)
from deployments.protocol import (CHAT_ONLY, APIError, CacheSalt, JSONSchemaSpec,
                                  ResponseFormat, SamplingFields, SamplingOptions,
                                  StructuredOutputs, _Base)
from deployments.responses_items import item_messages, need_object, validate

# the chat request's params, as a Responses request names them (in error objects)
RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                    "response_format": "text.format"}


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


class ReasoningConfig(_Base):
    effort: ReasoningEffort | None = None  # (as chat's reasoning_effort)
    summary: Literal["auto", "concise", "detailed"] | None = None  # (no summaries: echoed)


class ResponsesRequest(SamplingOptions):
    # vLLM's fields of the chat route that it takes too (the others are refused)
    FOLLOWED: ClassVar = ("include_stop_str_in_output", "skip_special_tokens")
    UNFOLLOWED: ClassVar[dict[str, object]] = {
        k: v for k, v in {**SamplingOptions.UNFOLLOWED, **SamplingFields.UNFOLLOWED,
                          **CHAT_ONLY}.items()
        if k not in ("include_stop_str_in_output", "skip_special_tokens")}
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # (as on the chat route)
    cache_salt: CacheSalt | None = None
    model: str | None = None
    input: str | list[Any]  # the items are checked in to_chat, each naming its index
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # checked in to_chat
    parallel_tool_calls: bool = True
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],  # (OpenAI's limits)
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool = False
    prompt: Any = None  # a stored prompt template: refused
    # auto: a conversation over the context loses its first items (responses_api.py)
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    # extensions, as on the chat route
    chat_template_kwargs: dict | None = None
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None

    def check_supported(self) -> None:
        if isinstance(self.conversation, dict) and \
                not isinstance(self.conversation.get("id"), str):
            raise APIError(400, "conversation must be an id or an object with an `id`",
                           "conversation", "invalid_value")
        if self.conversation is not None and self.previous_response_id is not None:
            raise APIError(400, "Mutually exclusive parameters: previous_response_id and "
                                "conversation; use one of them", "conversation",
                           "mutually_exclusive_parameters")
        if self.background and not self.store:
            raise APIError(400, "background responses must be stored: set store to true "
                                "(or leave it out)", "background", "invalid_value")
        if self.prompt is not None:
            raise APIError(400, "prompt (a stored prompt template) is not supported: this "
                                "server stores none; send the text as input", "prompt",
                           "unsupported_parameter")

    @property
    def conversation_id(self) -> str | None:
        """`conversation`: an id, or an object with one (checked by check_supported)."""
        return self.conversation["id"] if isinstance(self.conversation, dict) \
            else self.conversation

    @property
    def wants_logprobs(self) -> bool:
        """OpenAI's include names them; top_logprobs over 0 asks for them too."""
        return bool(self.top_logprobs) or "message.output_text.logprobs" in (self.include or [])

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            need_object(tool, f"tools.{i}")
            if tool.get("type") != "function":
                raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: "
                                    "this server runs function tools only",
                               f"tools.{i}.type", "unsupported_tool")
            tools.append(validate(FunctionTool, tool, f"tools.{i}"))
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
            reasoning_effort=self.reasoning.effort if self.reasoning else None,
            structured_outputs=self.structured_outputs, cache_salt=self.cache_salt,
            **self.model_dump(include=set(self.FOLLOWED)),
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

