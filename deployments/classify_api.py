"""vLLM's classify route, on a sequence classifier (`*ForSequenceClassification` served with
`runner: pooling`; engine_actors/pooling.py): POST /classify (also /v1/classify).

Request: `input` (a string, a list of strings, token ids, or a list of token-id lists),
`model`, `user`, and vLLM's `add_special_tokens` (default true), `truncate_prompt_tokens`,
`priority` and `use_activation` (false: the head's raw logits instead of probabilities).
Answer: {"id", "object": "list", "created", "model", "data": [{"index", "label", "probs",
"num_classes"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0,
"prompt_tokens_details": null}}. `probs` is the softmax of the logits over the labels (with
one label, or the checkpoint's `problem_type` multi_label_classification: a sigmoid each;
regression: the logits), and `label` the name (the checkpoint's id2label) of the likeliest.
"""
from __future__ import annotations

import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.embeddings_api import InputsRequest, pool_inputs, start_pooling
from deployments.frontend import Frontend
from deployments.protocol import APIError
from engine_actors.checkpoint import ModelInfo


class ClassifyRequest(InputsRequest):
    use_activation: bool | None = None


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(x / 2))  # (no overflow for any float)


def logits_of(outputs: list[bytes]) -> np.ndarray:
    """The workers' pooled outputs (float32 bytes) as [inputs, labels] float64 logits;
    APIError 500 if they are not finite (JSON has no NaN)."""
    logits = np.array([np.frombuffer(o, dtype="<f4") for o in outputs], np.float64)
    if not np.isfinite(logits).all():
        raise APIError(500, "the model's logits are not finite numbers", None,
                       "internal_error", "server_error")
    return logits


def activation(logits: np.ndarray, problem_type: str | None) -> np.ndarray:
    """[inputs, labels] logits (float64) as the checkpoint's `problem_type` reads them, as
    vLLM does: regression (a reward model) as they are, multi-label with a sigmoid each,
    else a softmax over the labels (one label: its sigmoid)."""
    if problem_type == "regression":
        return logits
    if problem_type == "multi_label_classification" or logits.shape[-1] == 1:
        return sigmoid(logits)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class ClassifyAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def routes(self) -> list[Route]:
        return [Route(path, self.create, methods=["POST"])
                for path in ("/classify", "/v1/classify")]

    async def create(self, request: Request):
        try:
            req, info = await start_pooling(self.frontend, request, ClassifyRequest)
            return JSONResponse(await self._classify(req, info))
        except APIError as e:
            return e.response()

    async def _classify(self, req: ClassifyRequest, info: ModelInfo) -> dict:
        frontend = self.frontend
        if not info.labels:
            raise APIError(400, "this server does not classify: serve a sequence classifier "
                                "(*ForSequenceClassification) with runner pooling", None,
                           "unsupported_task")
        ids, outputs = await pool_inputs(frontend, req, info, "classify")
        logits = logits_of(outputs)
        values = logits if req.use_activation is False else \
            activation(logits, info.config.get("problem_type"))
        num_tokens = sum(map(len, ids))
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": frontend.reported_model(req),
                "data": [{"index": i, "label": info.labels[int(np.argmax(row))],
                          "probs": values[i].tolist(), "num_classes": len(info.labels)}
                         for i, row in enumerate(logits)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None}}
