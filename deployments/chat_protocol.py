"""Chat completions: messages, tools and the request schema (see protocol.py for the
fields shared with completions and the error objects)."""
from __future__ import annotations

import functools
import inspect
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator
from pydantic_core import PydanticCustomError

from deployments.protocol import APIError, SamplingFields, _Base


class FunctionDefinition(_Base):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Base):
    name: str
    arguments: str  # JSON


class ToolCallMessage(_Base):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        import json
        try:
            arguments = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply: as sent
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ContentPart(_Base):
    type: str
    text: str | None = None

    def check_supported(self, param: str) -> None:
        if self.type != "text":
            raise APIError(400, f"content parts of type '{self.type}' are not supported: "
                                "this server serves text-only models", param,
                           "unsupported_content")
        if self.text is None:
            raise APIError(400, f"{param}.text: Field required", f"{param}.text",
                           "missing_required_parameter")


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # required but for assistant messages (OpenAI answers a missing parameter with 400)
    content: Annotated[str | list[ContentPart] | None, Field(validate_default=True)] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    # an assistant's earlier reasoning (vLLM's field, and its older name), which some chat
    # templates render (Qwen3's, for the turns after the last user message)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, v, info):
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("missing", "Field required")
        return v

    def text(self) -> str:
        """The content; text parts one per line (as vLLM joins them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates expect it (tool call arguments as objects)."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning is not None or self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning or self.reasoning_content
        return out


@functools.cache
def template_call_args() -> frozenset[str]:
    """The named arguments of transformers' apply_chat_template and of the template
    rendering under it (this version's): chat_template_kwargs adds template variables, and
    may not set these."""
    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils
    functions = [PreTrainedTokenizerBase.apply_chat_template,
                 getattr(chat_template_utils, "render_jinja_template", None)]
    return frozenset(name for f in functions if f is not None
                     for name, p in inspect.signature(f).parameters.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self") \
        | {"messages"}  # (the template's own variable, from the conversation)


def check_template_kwargs(kwargs: dict | None, param: str = "chat_template_kwargs") -> None:
    for key in kwargs or {}:
        if key in template_call_args():
            raise APIError(400, f"{param} may not set {key!r} (an argument of the template "
                                "call, not a template variable)", f"{param}.{key}",
                           "invalid_value")


def chat_template_text(value: str | None) -> str | None:
    """The server's chat_template arg as template text: the file it names, or the template
    itself; ValueError when it is neither, or does not parse."""
    import os

    import jinja2.sandbox
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"chat_template: no file {value!r}, and not a Jinja template")
    try:  # (as transformers compiles it; rendering errors show per request)
        jinja2.sandbox.ImmutableSandboxedEnvironment(
            extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template does not parse: {e} (line {e.lineno})") from None
    return value


# OpenAI's reasoning efforts, and vLLM's "max"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None  # -1: max_logprobs (vLLM's)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None
    # vLLM's: render without the assistant header, or let the model continue the last
    # message (an answer's prefill); start the answer with the last message (echo); the
    # documents of templates that take them (RAG)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None  # with the server's trust_request_chat_template only
    reasoning_effort: ReasoningEffort | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own around the template's text
    # vLLM's: false leaves the reasoning out of the answer (with a reasoning parser; unlike
    # vLLM, a grammar still applies after it)
    include_reasoning: bool = True
    # vLLM's: at most this many tokens of thinking, then </think> (with a reasoning parser;
    # engine_actors/thinking_budget.py); -1: no limit
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = None

    def logprob_fields(self) -> dict:
        if not self.logprobs and self.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs",
                           "invalid_value")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None,
                "prompt_logprobs": None if self.stream else self.prompt_logprobs}

    def check_supported(self) -> None:
        super().check_supported()
        check_template_kwargs(self.chat_template_kwargs)
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false "
                                "(the answer continues the last message, so no new one "
                                "starts)", "continue_final_message", "invalid_value")
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                part.check_supported(f"messages.{i}.content.{j}")
        names = {t.function.name for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in names:
            raise APIError(400, f"tool_choice names {self.tool_choice.function.name!r}, which "
                                "is not among the tools", "tool_choice", "invalid_value")
        if self.forces_tool_calls and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice", "invalid_value")

    def template_variables(self) -> dict | None:
        """chat_template_kwargs, and reasoning_effort as vLLM passes it: the variable
        `reasoning_effort`, and `enable_thinking` false for "none" (true otherwise) unless
        chat_template_kwargs set it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"enable_thinking": self.reasoning_effort != "none",
                **(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def response_role(self) -> str:
        """The answer's role: the assistant's, or with add_generation_prompt: false the last
        message's (the answer continues it), as vLLM."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str | None:
        """echo: the last message's content, if the answer has its role (vLLM's)."""
        last = self.messages[-1]
        if not self.echo or last.role != self.response_role():
            return None
        return last.text()  # as the template had it (continue_final_message goes on from it)

    @property
    def uses_tools(self) -> bool:
        """The output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def rendered_tools(self, exclude_when_none: bool) -> list[Tool] | None:
        """The tools the template renders: with tool_choice "none" too (the model is told of
        them, no call is parsed) unless `exclude_when_none`, as vLLM."""
        return None if self.tool_choice == "none" and exclude_when_none else self.tools

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function: the output must be calls."""
        return self.tool_choice not in (None, "none", "auto")

    # the Responses API's max_tool_calls (chat completions have no such field)
    _call_limit: int | None = PrivateAttr(None)

    def max_tool_calls(self) -> int | None:
        """How many calls one answer may hold (None: any number)."""
        return 1 if not self.parallel_tool_calls else self._call_limit

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
