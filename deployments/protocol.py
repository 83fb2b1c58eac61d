"""OpenAI request schemas, their validation, and OpenAI-style error objects.

Validation is strict about types (a string is not a number, 1e12 is not an integer, NaN is
not a temperature) and every failure names the offending `param`, as OpenAI's API does.
Unknown fields are ignored, as vLLM does; known-but-unsupported ones are refused clearly.
"""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

from engine_actors.request import MAX_SEED as MAX_SEED_ENGINE, SamplingParams

MAX_N = 16
MAX_STOP = 16  # stop strings per request, each at most MAX_STOP_CHARS (OpenAI allows 4)
MAX_STOP_CHARS = 512
MAX_SEED = MAX_SEED_ENGINE - MAX_N  # torch generators take 64-bit seeds; choice j uses seed + j
MAX_BATCH = 10_000  # requests per submitted batch
MAX_LOGIT_BIAS = 1024  # entries per request
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 128  # token sequences, as vLLM (a word may give two: with a leading space)
MAX_BAD_WORD_TOKENS = 64


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
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset()  # fields whose null is None, not unset
    RUNNER: ClassVar[str | None] = None  # the engine runner the route needs (None: either)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """An explicit null in an optional field means its default, as OpenAI's API and
        vLLM take it (openai-python sends null for a None in user code)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields
                    or fields[k].is_required() or k in cls.NULL_KEPT}
        return data

    def check_supported(self) -> None:
        """APIError 400 for what is not served (parse_body asks; by default nothing)."""


def check_runner(schema: type[_Base], runner: str) -> None:
    """APIError 400 when the route's schema needs the other runner (text generation on a
    pooling server, embeddings on a generating one), as vLLM refuses them."""
    if schema.RUNNER not in (None, runner):
        raise APIError(400, f"this route needs runner {schema.RUNNER}; this server was "
                            f"started with runner {runner}", None, "unsupported_runner")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


# vLLM's cache_salt: a prefix cache of its own (one tenant's prompts cannot be probed by
# another's cache hits); vLLM's limits
CacheSalt = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]+$")]


# vLLM's fields that only the chat route follows (the others refuse them)
CHAT_ONLY = {"thinking_token_budget": None}


class SamplingOptions(_Base):
    RUNNER: ClassVar[str | None] = "generate"
    """How one request samples and stops: shared by the OpenAI routes and the batch API.
    Unset (or null) temperature, top_p, top_k, min_p and the penalties take the checkpoint's
    generation_config values, else OpenAI's defaults (1, 1, off, off, none), as vLLM does."""
    # vLLM's request fields a route does not follow -> the value that changes nothing: any
    # other is refused (a client that sends one expects its effect, and ignoring it would
    # answer something else). The batch API and the Responses API take fewer than the
    # completions routes (SamplingFields).
    UNFOLLOWED: ClassVar[dict[str, object]] = {
        "bad_words": None, "include_stop_str_in_output": False, "skip_special_tokens": True,
        "truncate_prompt_tokens": None, "prompt_logprobs": None, "use_beam_search": False,
        "length_penalty": 1.0, "logits_processors": None, "structural_tag": None}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unfollowed(cls, data):
        for name, neutral in cls.UNFOLLOWED.items() if isinstance(data, dict) else ():
            neutral = neutral if isinstance(neutral, tuple) else (neutral,)
            if data.get(name) not in (None, *neutral):  # (request_body names the field)
                where = "by this server" if name in SamplingFields.UNFOLLOWED else \
                    "on this route (chat completions take it)" if name in CHAT_ONLY else \
                    "on this route (completions and chat completions take it)"
                raise PydanticCustomError("unsupported_parameter", f"not supported {where}",
                                          {"name": name})
        return data

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # vLLM: 0 or -1 disables
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # vLLM's; 0 disables
    seed: Annotated[int, Field(ge=-(2**63), le=MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # extension (vLLM): keep generating past EOS
    # extension: a deadline to start by, in ms after arrival (finish_reason "deadline")
    deadline_ms: Annotated[float, Field(gt=0, le=86_400_000)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None  # vLLM's
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM: no EOS or stop token before this
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],  # vLLM's: sample only these
                                 Field(min_length=1)] | None = None

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

    def sampling_params(self, max_tokens: int, choice: int = 0, defaults: dict | None = None,
                        vocab_size: int | None = None, **engine_fields) -> SamplingParams:
        """`defaults`: the checkpoint's sampling defaults (ModelInfo.sampling_defaults);
        `vocab_size` bounds logit_bias ids; engine_fields: further SamplingParams fields."""
        def pick(name, fallback):
            value = getattr(self, name)
            return value if value is not None else (defaults or {}).get(name, fallback)

        if self.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({self.min_tokens}) exceeds max_tokens "
                                f"({max_tokens})", "min_tokens", "invalid_value")
        seed = None if self.seed in (None, -1) else self.seed + choice  # -1: none (vLLM)
        # a grammar ends its output with EOS (all that is left to sample): keep it
        ignore_eos = self.ignore_eos and not engine_fields.get("grammar")
        return SamplingParams(
            max_tokens=max_tokens, temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0), top_k=max(pick("top_k", 0), 0),
            min_p=pick("min_p", 0.0), seed=seed,
            ignore_eos=ignore_eos, stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=_logit_bias(self.logit_bias, vocab_size), min_tokens=self.min_tokens,
            allowed_token_ids=_allowed_ids(self.allowed_token_ids, vocab_size), **engine_fields)


class JSONSchemaSpec(_Base):
    name: str = "response"
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TagStructure(_Base):
    """vLLM's older structural tag: text from `begin` to `end` follows `schema`."""
    begin: str
    schema_: dict | None = Field(None, alias="schema")  # (None: any JSON value)
    end: str


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaSpec | None = None
    # structural_tag (vLLM's): xgrammar's `format`, or the older `structures` and `triggers`
    format: dict | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(_Base):
    """vLLM's structured_outputs (one of these); its other options are refused, not ignored."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None  # EBNF (xgrammar's, GBNF-like), its start rule `root`
    json_object: bool | None = None
    structural_tag: str | None = None  # JSON: as response_format's structural_tag


class SamplingFields(SamplingOptions):
    """Fields shared by completions and chat completions."""
    UNFOLLOWED: ClassVar[dict[str, object]] = {
        "logits_processors": None, "guided_decoding_backend": ("xgrammar", "auto"),
        "guided_whitespace_pattern": None, "structural_tag": None,
        "repetition_detection": None, "vllm_xargs": None,
        "logprob_token_ids": None, "spaces_between_special_tokens": True,
        "return_prompt_text": (None, False), "watermarking": (None, False)}

    # structured output: OpenAI's response_format, vLLM's guided_* or structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: scheduling priority, lower first (default 0 = interactive; batches get 1)
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None
    # extension (vLLM): each choice also carries its prompt's and its output's token ids
    return_token_ids: bool = False
    # extension: end the request with HTTP 408 if it has not finished after this long
    timeout_s: Annotated[float, Field(gt=0, le=86_400)] | None = None
    user: str | None = None
    # vLLM's: the answer's id is "cmpl-"/"chatcmpl-" and this (else the X-Request-Id header,
    # which Serve's proxy sets when the client does not; engine requests have their own ids)
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # vLLM's: keep the ending stop string's (or token's) text; show special tokens; keep the
    # prompt's last n tokens (-1: all that fit); log-probabilities of prompt tokens (top n)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None  # -1: max_logprobs
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None  # vLLM's
    cache_salt: CacheSalt | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:{id}"
    # vLLM's beam search (deployments/beam_search.py): the n likeliest outputs, not samples
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(ge=-10, le=10)] = 1.0  # logprob / len ** this

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM
            raise APIError(400, "stream_options is only allowed with stream: true",
                           "stream_options", "invalid_value")
        if self.stream and self.prompt_logprobs:  # as vLLM: chunks have no place for them
            raise APIError(400, "prompt_logprobs are not available when stream is true",
                           "prompt_logprobs", "invalid_value")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise APIError(400, "length_penalty applies only with use_beam_search",
                           "length_penalty", "invalid_value")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1",
                           "truncate_prompt_tokens", "invalid_value")

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        return keep_last(ids, self.truncate_prompt_tokens, max_model_len)


def keep_last(ids: list[int], n: int | None, max_model_len: int) -> list[int]:
    """A prompt's ids as vLLM's truncate_prompt_tokens n keeps them: the last n (-1: as many
    as the context holds with room for one step; None: all)."""
    if n is None:
        return ids
    if n > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({n}) exceeds the model's maximum "
                            f"context length ({max_model_len})", "truncate_prompt_tokens",
                       "invalid_value")
    return ids[-(max_model_len - 1 if n == -1 else n):]


def _allowed_ids(ids: list[int] | None, vocab_size: int | None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if vocab_size is not None and max(ids) >= vocab_size:  # as logit_bias below
        raise APIError(400, f"allowed_token_ids must be token ids in [0, {vocab_size})",
                       "allowed_token_ids", "invalid_value")
    return tuple(sorted(set(ids)))


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> tuple:
    """OpenAI's {"token id": bias} -> ((id, bias), ...), ids checked against the vocab."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or (
                vocab_size is not None and int(key) >= vocab_size):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), "
                                f"got {key!r}", "logit_bias", "invalid_value")
        pairs.append((int(key), float(value)))
    return tuple(pairs)
