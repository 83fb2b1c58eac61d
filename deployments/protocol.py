"""OpenAI request schemas, their validation, and OpenAI-style error objects.

Validation is strict about types (a string is not a number, 1e12 is not an integer, NaN is
not a temperature) and every failure names the offending `param`, as OpenAI's API does.
Unknown fields are ignored, as vLLM does; known-but-unsupported ones are refused clearly.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

from engine_actors.request import MAX_SEED as MAX_SEED_ENGINE, SamplingParams

MAX_N = 16
MAX_STOP = 16  # stop strings per request, each at most MAX_STOP_CHARS (OpenAI allows 4)
MAX_STOP_CHARS = 512
MAX_SEED = MAX_SEED_ENGINE - MAX_N  # torch generators take 64-bit seeds; choice j uses seed + j
MAX_BATCH = 10_000  # requests per submitted batch


class APIError(Exception):
    """An error that becomes an HTTP response with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = err_type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool = False


class SamplingOptions(_Base):
    """How one request samples and stops: shared by the OpenAI routes and the batch API.
    Unset (or null) temperature, top_p and top_k take the checkpoint's generation_config
    values, else OpenAI's defaults (1, 1, off), as vLLM does."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # vLLM: 0 or -1 disables
    seed: Annotated[int, Field(ge=-(2**63), le=MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # extension (vLLM): keep generating past EOS
    # extension: a deadline to start by, in ms after arrival (finish_reason "deadline")
    deadline_ms: Annotated[float, Field(gt=0, le=86_400_000)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int, choice: int = 0,
                        defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the checkpoint's sampling defaults (ModelInfo.sampling_defaults)."""
        def pick(name, fallback):
            value = getattr(self, name)
            return value if value is not None else (defaults or {}).get(name, fallback)

        seed = None if self.seed is None else self.seed + choice  # n choices must differ
        return SamplingParams(max_tokens=max_tokens, temperature=pick("temperature", 1.0),
                              top_p=pick("top_p", 1.0), top_k=max(pick("top_k", 0), 0),
                              seed=seed, ignore_eos=self.ignore_eos)

    def check_supported(self) -> None:
        pass


class SamplingFields(SamplingOptions):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extension: scheduling priority (higher first; default 1 = interactive, batches get 0)
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None
    # extension: end the request with HTTP 408 if it has not finished after this long
    timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    user: str | None = None
    # accepted only at their neutral values
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def check_supported(self) -> None:
        unsupported = {"presence_penalty": self.presence_penalty != 0.0,
                       "frequency_penalty": self.frequency_penalty != 0.0,
                       "logit_bias": bool(self.logit_bias),
                       "logprobs": self.logprobs not in (None, False)}
        for param, is_set in unsupported.items():
            if is_set:
                raise APIError(400, f"{param} is not supported by this server", param,
                               "unsupported_parameter")


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix",
                           "unsupported_parameter")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported by this server", "best_of",
                           "unsupported_parameter")


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # required but for assistant messages (OpenAI answers a missing parameter with 400)
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_required(cls, v, info):
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("missing", "Field required")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported by this server", "tools",
                           "unsupported_parameter")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "response_format other than text is not supported",
                           "response_format", "unsupported_parameter")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class BatchItem(SamplingOptions):
    """One request of a submitted batch."""
    prompt: str | list[int]
    max_tokens: Annotated[int, Field(ge=1)] = 16


class BatchSubmit(_Base):
    """A background batch (native endpoint): scheduled per request, at low priority."""
    model: str | None = None
    requests: Annotated[list[BatchItem], Field(min_length=1, max_length=MAX_BATCH)]
    priority: Annotated[int, Field(ge=-100, le=100)] = 0

    def check_supported(self) -> None:
        pass


def refusal_error(code: str, message: str, param: str | None = "max_tokens") -> APIError:
    """The HTTP answer to the scheduler refusing a request."""
    if code == "queue_full":
        return APIError(429, message, None, "queue_full", "rate_limit_error",
                        headers={"Retry-After": "1"})
    if code == "draining":
        return APIError(503, message, None, "shutting_down", "service_unavailable")
    codes = {"too_long": "context_length_exceeded", "batch_too_large": "batch_too_large"}
    return APIError(400, message, param, codes.get(code, "invalid_value"))


def parse_body(raw: bytes, schema: type[_Base]) -> Any:
    """Bytes of an HTTP body -> a validated request, or APIError(400) naming the param."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", None, "invalid_encoding") from None
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", None, "invalid_type")
    try:
        req = schema.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param,
                       code) from None
    req.check_supported()
    return req


def _is_union_tag(loc_part) -> bool:
    """pydantic names union members in error locations ('str', 'list[int]'); OpenAI does not."""
    return isinstance(loc_part, str) and (loc_part in {"str", "int", "float", "bool"}
                                          or "[" in loc_part or loc_part.endswith("Part"))
