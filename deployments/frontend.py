"""What every route of an ingress replica shares: the engines' client, the tokenizer, and
the one validation path of requests (body size, schema, model name, prompts), which the
OpenAI routes (`openai_api.py`) and the batch API (`batch_api.py`) both go through."""
from __future__ import annotations

import asyncio
import copy
import logging
import threading

import jinja2
from starlette.requests import Request

from deployments.engine_client import EngineFailed, EngineUnavailable
from deployments.engines import Engines
from deployments.http_metrics import HTTPMetrics
from deployments.protocol import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, APIError, check_runner
from deployments.request_body import parse_body
from deployments.structured import default_tool_parser
from engine_actors.checkpoint import ModelInfo, load_tokenizer, resolve_model_path
from engine_actors.config import EngineConfig

logger = logging.getLogger("orca_serve.ingress")
MAX_BODY_BYTES = 4 * 1024 * 1024
LONG_TEXT_CHARS = 1 << 16  # longer text is tokenized on a thread, not on the event loop


def unavailable(message: str) -> APIError:
    return APIError(503, message, err_type="service_unavailable")


def refusal_error(code: str, message: str, param: str | None = "max_tokens") -> APIError:
    """The HTTP answer to the scheduler refusing a request."""
    if code == "queue_full":
        return APIError(429, message, None, "queue_full", "rate_limit_error",
                        headers={"Retry-After": "1"})
    if code == "draining":
        return APIError(503, message, None, "shutting_down", "service_unavailable")
    if code == "unknown_model":
        return APIError(404, message, "model", "model_not_found")
    if code == "unknown_after":  # a list's page after an id it does not hold
        return APIError(400, message, "after", "invalid_value")
    if code == "invalid_state":  # e.g. cancelling a job that has ended
        return APIError(409, message, None, code)
    codes = {"too_long": "context_length_exceeded", "batch_too_large": "batch_too_large",
             "lora_disabled": "lora_disabled", "invalid_adapter": "invalid_lora_adapter"}
    return APIError(400, message, param, codes.get(code, "invalid_value"))


class Frontend:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.client = Engines(cfg)  # (one EngineClient per data-parallel engine)
        self.metrics = HTTPMetrics(cfg.model_name)
        self.tokenizer = None
        self.is_draining = False
        # why the engine could not start: final (vLLM exits too); every request gets it
        self.failure: str | None = None
        self._starting: asyncio.Task | None = None
        self.on_ready = None  # called once, the first time the engine is up
        self.on_failure = None  # called once, when the engine cannot start
        # long text is tokenized on a thread, by a copy of the tokenizer of its own (a fast
        # tokenizer's settings are not safe to share between threads), one at a time per
        # lane: prompts, and training files (which may take a minute)
        self._lanes = {lane: [threading.Lock(), None] for lane in ("prompts", "training")}

    # ---- the engine ---------------------------------------------------------------------
    def start(self) -> asyncio.Task:
        """Bring the engine up in the background. Once it is up, a scheduler that died is
        brought up again by the next request; a start that fails is final."""
        if self._starting is None or (self._starting.done() and not self.failure
                                      and not self.client.is_connected):
            self._starting = asyncio.get_running_loop().create_task(self._start())
        return self._starting

    @property
    def is_started(self) -> bool:
        return self._starting is not None and self._starting.done() \
            and not self._starting.exception() and self.client.is_connected

    async def _start(self) -> None:
        try:
            # the tokenizer loads (transformers' imports: seconds on a small CPU) while the
            # engine's actors start
            outcomes = await asyncio.gather(self._load_tokenizer(), self.client.connect(),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except asyncio.CancelledError:
            raise
        except EngineFailed as e:
            self._fail(str(e))
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}")
        if self.failure is None and self.on_ready is not None:
            callback, self.on_ready = self.on_ready, None
            await callback()

    async def _load_tokenizer(self) -> None:
        if self.tokenizer is None:
            tokenizer = await asyncio.to_thread(load_tokenizer,
                                                resolve_model_path(self.cfg.model))
            if self.cfg.chat_template is not None:  # the server's, over the checkpoint's
                tokenizer.chat_template = self.cfg.chat_template
            self.tokenizer = tokenizer

    def request_template(self, template: str | None) -> str | None:
        """A request's own chat_template: only on a server that trusts them (as vLLM)."""
        if template is not None and not self.cfg.trust_request_chat_template:
            raise APIError(400, "a chat_template in the request needs the server's "
                                "trust_request_chat_template: true", "chat_template",
                           "unsupported_parameter")
        return template

    def _fail(self, cause: str) -> None:
        self.failure = cause
        logger.error("orca-serve: the engine failed to start: %s", cause)
        if self.on_failure is not None:
            self.on_failure(cause)

    async def ready(self) -> ModelInfo:
        """The model info once the engine serves; APIError 503 while it cannot."""
        try:
            await asyncio.shield(self.start())
        except EngineUnavailable as e:
            raise unavailable(f"engine unavailable: {e}") from None
        if self.failure is not None:
            raise APIError(503, f"the engine failed to start: {self.failure}", None,
                           "engine_start_failed", "service_unavailable")
        if not self.client.is_connected:  # the scheduler died since: bring a new one up
            return await self.ready()
        return self.client.info

    async def call(self, method: str, *args):
        """A call on the scheduler actor; APIError 503 when the engine is gone."""
        try:
            return await self.client.call(method, *args)
        except EngineUnavailable as e:
            raise unavailable(str(e)) from None

    def refuse_if_draining(self) -> None:
        if self.is_draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down",
                           "service_unavailable")

    # ---- requests -----------------------------------------------------------------------
    async def parse(self, request: Request, schema):
        """The body of `request` as `schema`, its model checked; APIError 4xx otherwise."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise _too_large()
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
        check_runner(schema, self.cfg.runner)
        req = parse_body(body, schema)
        if "request_id" in schema.model_fields and req.request_id is None:  # (Serve's proxy
            req.request_id = request.headers.get("x-request-id", "")[:256] or None  # sets one)
        model = getattr(req, "model", None)
        # another name may be a LoRA adapter: the engine knows them, and answers 404 if not
        if model is not None and model not in self.cfg.model_names and \
                not self.cfg.lora_enabled:
            raise APIError(404, f"The model `{model}` does not exist. This server serves "
                                f"`{self.cfg.model_name}`.", "model", "model_not_found")
        return req

    def refuse_over_queue(self, count: int, what: str, param: str, engines: int = 1) -> None:
        """APIError 400 when one body brings more requests than the queue holds (checked
        before they are all tokenized); `engines`: the queues it is shared out over."""
        queue = self.cfg.max_queued_requests * engines
        if count > queue:
            raise APIError(400, f"{what} are more requests than the queue of {queue} holds; "
                                "split them", param, "batch_too_large")

    def adapter(self, req) -> str | None:
        """The LoRA adapter a request names in `model` (None: the base model)."""
        model = getattr(req, "model", None)
        return model if model is not None and model not in self.cfg.model_names else None

    def reported_model(self, req) -> str:
        """The answer's `model`: the request's adapter, else the base's first name (vLLM)."""
        return req.model if self.adapter(req) else self.cfg.model_name

    async def check_served(self, req) -> None:
        """APIError (404) unless `model` names the base model or an adapter that is (or,
        with dynamic_lora_loading_path, now gets) loaded: for routes that skip the engine."""
        name = self.adapter(req)
        refusal = await self.call("adapter_call", "served", name) if name else None
        if refusal is not None:
            raise refusal_error(refusal.code, refusal.message, "model")

    def tool_parser(self, info: ModelInfo) -> str:
        """The tool-call format of the served model (the tool_call_parser arg, or its
        family's)."""
        if self.cfg.tool_call_parser != "auto":
            return self.cfg.tool_call_parser
        return default_tool_parser(self.tokenizer, info.architecture)

    async def tokenize(self, fn, chars: int, lane: str = "prompts"):
        """fn(tokenizer), for text of `chars` characters in all. More than LONG_TEXT_CHARS
        (a 4 MB prompt takes seconds) are tokenized on a thread, so that the replica's other
        requests go on meanwhile."""
        if chars <= LONG_TEXT_CHARS:
            return fn(self.tokenizer)
        if self._lanes[lane][1] is None:
            self._lanes[lane][1] = copy.deepcopy(self.tokenizer)
        return await asyncio.to_thread(self._tokenize_on_thread, fn, lane)

    def _tokenize_on_thread(self, fn, lane: str):
        lock, tokenizer = self._lanes[lane]
        with lock:
            return fn(tokenizer)

    async def chat_ids(self, messages: list, tools: list | None,
                       add_generation_prompt: bool = True, add_special_tokens: bool = False,
                       template_kwargs: dict | None = None, continue_final_message=False,
                       documents: list | None = None, template: str | None = None
                       ) -> list[int]:
        """Token ids of chat messages (ChatMessage) and tools (Tool) as the chat template
        (or `template`, a request's own) renders them, with the server's
        default_chat_template_kwargs and the request's `template_kwargs` over them as
        template variables; APIError 400 when it cannot. continue_final_message: the text
        ends with the last message's (no end of turn)."""
        messages = [m.for_template() for m in messages]
        tools = [t.model_dump(by_alias=True, exclude_none=True) for t in tools] \
            if tools else None
        variables = {**(self.cfg.default_chat_template_kwargs or {}), **(template_kwargs or {})}

        def render(tokenizer) -> list[int]:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, documents=documents, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=template,
                continue_final_message=continue_final_message, **variables)
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        size = len(str(messages)) + len(str(tools or "")) + len(str(variables)) + \
            len(str(documents or ""))
        try:
            return await self.tokenize(render, size)
        except jinja2.TemplateSyntaxError as e:  # (only a request's can fail to parse)
            raise APIError(400, f"chat_template does not parse: {e}", "chat_template",
                           "invalid_value") from None
        except Exception as e:
            with_variables = " (with chat_template_kwargs)" if template_kwargs else ""
            raise APIError(400, f"messages could not be formatted{with_variables}: {e}",
                           "messages") from None

    async def prompt_ids(self, prompts: list[str | list[int]], info: ModelInfo,
                         params: list[str], special: bool = True) -> list[list[int]]:
        """Token ids of each prompt (text is tokenized, all in one go, with the tokenizer's
        special tokens if `special`; ids are checked against the vocab); APIError 400 naming
        the prompt's param."""
        texts = [p for p in prompts if isinstance(p, str) and p]
        encoded = iter(await self.tokenize(
            lambda t: [t.encode(text, add_special_tokens=special) for text in texts],
            sum(map(len, texts))))
        out = []
        for prompt, param in zip(prompts, params):
            if isinstance(prompt, str):
                ids = next(encoded) if prompt else []
            else:
                ids = list(prompt)
                if any(not 0 <= t < info.vocab_size for t in ids):
                    raise APIError(400, f"prompt token ids must be in [0, {info.vocab_size})",
                                   param, "invalid_value")
            if not ids:
                raise APIError(400, "prompt must not be empty", param, "invalid_value")
            out.append(ids)
        return out


async def bad_word_ids(frontend: Frontend, words: list[str],
                       vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token ids: each word as written (leading spaces stripped), and
    with one leading space where that starts with another token and is as long."""
    def encode(tokenizer) -> list[tuple[int, ...]]:
        out = []
        for i, word in enumerate(words):
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not 0 < len(plain) <= MAX_BAD_WORD_TOKENS:  # the engine's tables grow with it
                raise APIError(400, f"bad_words must be words of 1 to {MAX_BAD_WORD_TOKENS} "
                                    "tokens", f"bad_words.{i}", "invalid_value")
            if max(plain) >= vocab_size:  # a tokenizer's added token past the model's logits
                raise APIError(400, f"bad_words.{i} has a token the model does not predict",
                               f"bad_words.{i}", "invalid_value")
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(tuple(plain))
            if spaced[0] != plain[0] and len(spaced) == len(plain) and max(spaced) < vocab_size:
                out.append(tuple(spaced))
        return out
    ids = await frontend.tokenize(encode, sum(map(len, words)))
    if len(ids) > MAX_BAD_WORDS:
        raise APIError(400, f"bad_words give {len(ids)} token sequences, over "
                            f"{MAX_BAD_WORDS}", "bad_words", "invalid_value")
    return tuple(ids)


def _too_large() -> APIError:
    return APIError(413, f"request body over {MAX_BODY_BYTES} bytes", None, "request_too_large")
