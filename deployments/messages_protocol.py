"""Anthropic's Messages API request (POST /v1/messages and /v1/messages/count_tokens), and
its conversion into a chat completion request, as vLLM serves it.

A Messages request is a chat request in other clothes: `system` is a system message first,
content blocks become chat messages (`tool_use` blocks an assistant's tool calls,
`tool_result` blocks tool messages, `thinking` blocks an assistant's reasoning), `tools`
take their JSON schema from `input_schema`, `tool_choice` "any" is "required", and a last
assistant message is a prefill that the answer continues. `thinking` and
`output_config.effort` reach the chat template as vLLM passes them; without `thinking`, as
on Anthropic's API, thinking is off (the template's enable_thinking false). The content
blocks are converted by messages_content.py. What this server cannot follow (images,
documents, server tools, MCP servers, containers) is refused.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from deployments.chat_protocol import (ChatCompletionRequest, ChatMessage, FunctionDefinition,
                                       NamedFunction, NamedToolChoice, Tool)
from deployments.messages_content import MessageParam, chat_messages, text_of
from deployments.protocol import (CHAT_ONLY, MAX_STOP, MAX_STOP_CHARS, APIError, CacheSalt,
                                  JSONSchemaSpec, ResponseFormat, SamplingFields,
                                  SamplingOptions, _Base)
from deployments.responses_items import need_object, validate


class ToolParam(_Base):
    type: Literal["custom"] | None = None  # (a server tool has a versioned type: refused)
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict
    strict: bool | None = None


class ToolChoiceParam(_Base):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Base):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None  # (Anthropic's minimum)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Base):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Base):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Base):
    user_id: str | None = None


class CountTokensRequest(SamplingOptions):
    """The fields that make the prompt (count_tokens takes these); MessagesRequest adds
    the answer's."""
    RUNNER: ClassVar[str | None] = None  # (counting tokens needs no text generation)
    # as the Responses API: vLLM's fields of the chat route are refused here
    UNFOLLOWED: ClassVar[dict[str, object]] = {
        **SamplingOptions.UNFOLLOWED, **SamplingFields.UNFOLLOWED, **CHAT_ONLY}
    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Any], Field(min_length=1)]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # (the structured-outputs beta's name)
    mcp_servers: list[Any] | None = None
    container: Any = None
    # extensions, as on the chat route
    chat_template_kwargs: dict | None = None

    def check_supported(self) -> None:
        for name in ("mcp_servers", "container"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported: this server runs no server "
                                    "tools", name, "unsupported_parameter")
        if self.thinking is not None and self.thinking.type == "enabled" and \
                self.thinking.budget_tokens is None:
            raise APIError(400, "thinking.budget_tokens: Field required",
                           "thinking.budget_tokens", "missing_required_parameter")

    def to_chat(self, **answer) -> ChatCompletionRequest:
        """The equivalent chat completion request (`answer`: its fields for the answer);
        APIError(400) naming the offending Messages param."""
        system = text_of(self.system, "system", system=True) if self.system else ""
        messages = [ChatMessage(role="system", content=system)] if system else []
        for i, m in enumerate(self.messages):
            need_object(m, f"messages.{i}")
            messages += chat_messages(validate(MessageParam, m, f"messages.{i}"), i)
        prefill = self.messages[-1].get("role") == "assistant"  # the answer continues it
        if prefill and (messages[-1].tool_calls or messages[-1].role != "assistant"):
            raise APIError(400, "a last assistant message (a prefill) may hold only text",
                           f"messages.{len(self.messages) - 1}.content", "invalid_value")
        tools = [_tool(t, i) for i, t in enumerate(self.tools or [])]
        choice = self.tool_choice
        chat = ChatCompletionRequest(
            messages=messages, tools=tools or None, tool_choice=_tool_choice(choice),
            parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
            add_generation_prompt=not prefill, continue_final_message=prefill,
            response_format=self._response_format(), model=self.model,
            chat_template_kwargs=self._template_kwargs(),
            reasoning_effort=self._effort(), **answer,
            **self.model_dump(include=set(SamplingOptions.model_fields) - set(answer)))
        chat.check_supported()
        return chat

    def _template_kwargs(self) -> dict | None:
        """The template's enable_thinking, unless chat_template_kwargs sets it: true when
        thinking is on (enabled, adaptive, between tools), false without `thinking`
        (Anthropic's default); off is reasoning effort "none" (_effort)."""
        if self.thinking is not None and self.thinking.type == "disabled":
            return self.chat_template_kwargs
        return {"enable_thinking": self.thinking is not None, **(self.chat_template_kwargs or {})}

    def _effort(self) -> str | None:
        if self.thinking is not None and self.thinking.type == "disabled":
            return "none"
        return self.output_config.effort if self.output_config else None

    def _response_format(self) -> ResponseFormat | None:
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        if fmt is None:
            return None
        return ResponseFormat(type="json_schema",
                              json_schema=JSONSchemaSpec(name="output", schema=fmt.schema_))


class MessagesRequest(CountTokensRequest):
    RUNNER: ClassVar[str | None] = "generate"
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1,
                                                        max_length=MAX_STOP_CHARS)]],
                              Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # extensions, as on the chat route
    cache_salt: CacheSalt | None = None
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if len(self.stops()) > MAX_STOP:
            raise APIError(400, f"at most {MAX_STOP} stop sequences (stop_sequences and "
                                "stop together)", "stop_sequences", "invalid_value")

    def chat(self) -> ChatCompletionRequest:
        """display "omitted" leaves the thinking out of the answer (vLLM's
        include_reasoning: false): the model still thinks."""
        omitted = self.thinking is not None and self.thinking.display == "omitted"
        return self.to_chat(max_tokens=self.max_tokens, stream=self.stream,
                            stop=self.stops() or None, cache_salt=self.cache_salt,
                            priority=self.priority, timeout_s=self.timeout_s,
                            include_reasoning=not omitted,
                            user=self.metadata.user_id if self.metadata else None)

    def stops(self) -> list[str]:
        """stop_sequences, and vLLM's `stop` (which a chat route takes) after them."""
        return (self.stop_sequences or []) + self.stop_list()


def _tool(tool, i: int) -> Tool:
    need_object(tool, f"tools.{i}")
    if tool.get("type") not in (None, "custom"):
        raise APIError(400, f"tools of type {tool.get('type')!r} are not supported: this "
                            "server runs client tools only (no server tools)",
                       f"tools.{i}.type", "unsupported_tool")
    t = validate(ToolParam, tool, f"tools.{i}")
    return Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict))


def _tool_choice(choice: ToolChoiceParam | None) -> str | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice.name is required with type \"tool\"",
                           "tool_choice.name", "missing_required_parameter")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"any": "required"}.get(choice.type, choice.type)
