"""OpenAI's embeddings route, served as vLLM serves it with its pooling runner (the server
started with `runner: pooling`; engine_actors/pooling.py): POST /v1/embeddings.

Request: `input` (a string, a list of strings, token ids, or a list of token-id lists),
`model`, `encoding_format` (`float`, or `base64`: the little-endian float32 bytes, which
the `openai` client asks for by default), `dimensions` (the first n values, normalized
again, as OpenAI's text-embedding-3 shortens them), `user`; and vLLM's
`add_special_tokens` (default true), `truncate_prompt_tokens` and `priority`. vLLM's chat
form instead of `input`: `messages`, rendered by the chat template as one input (with
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`, default false,
and `add_special_tokens` default false: the template writes them), as on every route that
takes `input` (/classify, /pooling). Answer:
{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}.
"""
from __future__ import annotations

import base64
import uuid
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.chat_protocol import ChatMessage, check_template_kwargs
from deployments.completion_protocol import Prompt
from deployments.engine_client import EngineUnavailable, RequestRefused
from deployments.frontend import Frontend, refusal_error, unavailable
from deployments.openai_api import PromptTooLong, within
from deployments.protocol import APIError, _Base, keep_last
from deployments.responses import timeout_error
from engine_actors.checkpoint import ModelInfo, resolve_model_path
from engine_actors.messages import EngineRequest
from engine_actors.pooling import read_pooling
from engine_actors.request import SamplingParams


class PoolingRequest(_Base):
    """The fields of every pooling route's request (embeddings, score_api.py's)."""
    RUNNER: ClassVar[str] = "pooling"
    model: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None

    def check_supported(self) -> None:
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 or positive",
                           "truncate_prompt_tokens", "invalid_value")


class InputsRequest(PoolingRequest):
    """A request of pooling routes that take `input` or `messages` (embeddings,
    classify_api.py's, pooling_api.py's)."""
    input: Prompt | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    add_special_tokens: bool | None = None  # (default: true for input, false for messages)
    chat_template: str | None = None  # with the server's trust_request_chat_template only
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if (self.input is None) == (self.messages is None):
            if self.input is None:
                raise APIError(400, "input (or messages) is required", "input",
                               "missing_required_parameter")
            raise APIError(400, "give input or messages, not both", "messages",
                           "invalid_value")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages must not be empty", "messages", "invalid_value")
        check_template_kwargs(self.chat_template_kwargs)

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        if not self.input:
            raise APIError(400, "input must not be empty", "input", "invalid_value")
        return list(self.input)


class EmbeddingRequest(InputsRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None


class EmbeddingsAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.normalize: bool | None = None  # whether the model's embeddings are normalized

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.create, methods=["POST"])]

    async def create(self, request: Request):
        try:
            return JSONResponse(await self._create(request))
        except APIError as e:
            return e.response()

    async def _create(self, request: Request) -> dict:
        frontend = self.frontend
        req, info = await start_pooling(frontend, request, EmbeddingRequest)
        if info.scores or info.labels:  # (a reranker, a sequence classifier or both)
            routes = (["/classify"] if info.labels else []) + \
                (["/v1/score", "/v1/rerank"] if info.scores else [])
            raise APIError(400, "this server classifies or scores, it does not embed: POST "
                                + " or ".join(routes), None, "unsupported_task")
        ids, vectors = await pool_inputs(frontend, req, info, "embd")
        if self.normalize is None:  # (the checkpoint's, as the workers read it)
            self.normalize = read_pooling(resolve_model_path(frontend.cfg.model)).normalize
        size = len(vectors[0]) // 4
        if req.dimensions is not None and req.dimensions > size:
            raise APIError(400, f"dimensions ({req.dimensions}) exceeds the model's {size}",
                           "dimensions", "invalid_value")
        num_tokens = sum(map(len, ids))
        return {"object": "list", "model": frontend.reported_model(req),
                "data": [{"object": "embedding", "index": i,
                          "embedding": encode(v, req.dimensions, req.encoding_format,
                                              self.normalize)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def start_pooling(frontend: Frontend, request: Request, schema: type[InputsRequest]
                        ) -> tuple[InputsRequest, ModelInfo]:
    """A pooling route's request, parsed and checked (not while draining), and the model's
    info."""
    frontend.refuse_if_draining()
    req = await frontend.parse(request, schema)
    req.check_supported()
    return req, await frontend.ready()


async def pool_inputs(frontend: Frontend, req: InputsRequest, info: ModelInfo, kind: str
                      ) -> tuple[list[list[int]], list[bytes]]:
    """Each input's token ids (tokenized, truncated, checked) and its pooled output (float32
    bytes); `kind` starts the engine requests' ids."""
    if req.messages is not None:  # one input: the chat template's rendering
        params = ["messages"]
        ids = [await frontend.chat_ids(
            req.messages, None, req.add_generation_prompt, bool(req.add_special_tokens),
            req.chat_template_kwargs, req.continue_final_message,
            template=frontend.request_template(req.chat_template))]
    else:
        prompts = req.prompts()
        frontend.refuse_over_queue(len(prompts), f"{len(prompts)} inputs", "input")
        params = ["input"] if len(prompts) == 1 else [f"input.{i}" for i in range(len(prompts))]
        ids = await frontend.prompt_ids(prompts, info, params, req.add_special_tokens is not False)
    limit = info.max_model_len
    n = req.truncate_prompt_tokens
    if n == limit:  # (keep limit - 1: room for the one step)
        n = limit - 1
    ids = [keep_last(p, n, limit) for p in ids]
    for p, param in zip(ids, params):
        if len(p) >= limit:
            raise PromptTooLong(len(p), limit, param)
    base = f"{kind}-{uuid.uuid4().hex}"
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    requests = [EngineRequest(f"{base}-{i}", p, sampling, req.priority or 0,
                              lora_name=frontend.adapter(req))
                for i, p in enumerate(ids)]
    return ids, await run_pooling(frontend, requests, "input")


async def run_pooling(frontend: Frontend, requests: list[EngineRequest],
                      param: str) -> list[bytes]:
    """The embedding (or score) of each request, in order, as float32 bytes; APIError when
    one could not be made (`param`: the one a refusal names)."""
    timeout = frontend.cfg.request_timeout_s
    try:
        group = await frontend.client.submit(requests, wake_each_update=False)
    except RequestRefused as e:
        raise refusal_error(e.code, str(e), param) from None
    except EngineUnavailable as e:
        raise unavailable(str(e)) from None
    out: dict[str, bytes] = {}
    try:
        async for rid, update in within(group, timeout):
            if update.finish_reason is not None:
                if update.embedding is None:  # aborted, failed or drained
                    raise unavailable(f"request failed: {update.error or 'no embedding'}")
                out[rid] = update.embedding
    except TimeoutError:
        raise timeout_error(timeout) from None
    except EngineUnavailable as e:
        raise unavailable(f"request failed: {e}") from None
    finally:
        group.close()
    return [out[r.request_id] for r in requests]


def encode(vector: bytes, dimensions: int | None, encoding_format: str, normalize: bool):
    """One embedding (float32 bytes, the engine's) as the answer carries it: shortened to
    `dimensions` (and normalized again if the model's are), as floats or base64
    little-endian float32."""
    values = np.frombuffer(vector, dtype="<f4")
    if dimensions is not None and dimensions < values.shape[0]:
        values = values[:dimensions]
        if normalize:
            values = values / max(float(np.linalg.norm(values)), 1e-12)
        vector = values.astype("<f4").tobytes()
    if encoding_format == "base64":
        return base64.b64encode(vector).decode()
    return values.tolist()

