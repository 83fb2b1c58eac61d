"""vLLM's generic pooling route, on any model served with `runner: pooling`: POST /pooling
(also /v1/pooling). Each input's pooled output, whatever the model pools:
- an embedding model: its embedding (normalized if the model's are), as /v1/embeddings;
- a sequence classifier: its labels' probabilities (or the checkpoint's problem_type's
  values), as /classify's `probs`;
- a reranker (classifier_from_token) or a one-label classifier: [its score], as /v1/score's.

Request: `input` (a string, a list of strings, token ids, or a list of token-id lists),
`model`, `user`, `encoding_format` (`float`, or `base64`: little-endian float32 bytes), and
vLLM's `add_special_tokens` (default true), `truncate_prompt_tokens`, `priority` and
`use_activation` (false: a classifier's or reranker's raw logits). Answer: {"id": "pool-...",
"object": "list", "created", "model", "data": [{"index", "object": "pooling", "data"}],
"usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0,
"prompt_tokens_details": null}}.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.classify_api import activation, logits_of, sigmoid
from deployments.embeddings_api import InputsRequest, encode, pool_inputs, start_pooling
from deployments.frontend import Frontend
from deployments.protocol import APIError
from engine_actors.checkpoint import ModelInfo


class PoolingRequest(InputsRequest):
    encoding_format: Literal["float", "base64"] = "float"
    use_activation: bool | None = None


class PoolingAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def routes(self) -> list[Route]:
        return [Route(path, self.create, methods=["POST"])
                for path in ("/pooling", "/v1/pooling")]

    async def create(self, request: Request):
        try:
            req, info = await start_pooling(self.frontend, request, PoolingRequest)
            return JSONResponse(await self._pool(req, info))
        except APIError as e:
            return e.response()

    async def _pool(self, req: PoolingRequest, info: ModelInfo) -> dict:
        frontend = self.frontend
        ids, outputs = await pool_inputs(frontend, req, info, "pool")
        if info.labels or info.scores:  # a classifier's logits, or a reranker's one logit
            logits = logits_of(outputs)
            if req.use_activation is not False:
                logits = sigmoid(logits) if info.scores and not info.labels else \
                    activation(logits, info.config.get("problem_type"))
            outputs = [row.astype("<f4").tobytes() for row in logits]
        num_tokens = sum(map(len, ids))
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": frontend.reported_model(req),
                "data": [{"index": i, "object": "pooling",
                          "data": encode(o, None, req.encoding_format, False)}
                         for i, o in enumerate(outputs)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None}}
