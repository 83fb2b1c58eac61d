"""vLLM's score and rerank routes, for a causal LM served as a reranker (runner pooling with
`classifier_from_token`, as Qwen3-Reranker is served: engine_actors/pooling.py).

Each (query, document) pair is scored at the last token of the two texts joined, encoded
as one text with the tokenizer's special tokens, as vLLM scores a causal LM made a
reranker. As in vLLM, the texts are taken as they come: a reranker's own prompt format
(Qwen3-Reranker's system prompt, `<Instruct>`, `<Query>`, `<Document>`) is the client's to
write.

- POST /score, /v1/score: `text_1` and `text_2` (a string or a list of strings each: one to
  one, one to many, or many to many of the same length; or under vLLM's other names,
  `queries` and `documents`, `queries` and `items`, `data_1` and `data_2`) -> {"id",
  "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}],
  "usage"}.
- POST /rerank, /v1/rerank, /v2/rerank: `query`, `documents`, `top_n` (0, less, or absent:
  all) -> {"id", "model", "usage", "results": [{"index", "document": {"text"},
  "relevance_score"}]}, best first.
Both take `truncate_prompt_tokens` (a pair keeps its last n tokens), `priority` and
`use_activation` (false: the raw logit, logit(yes) - logit(no), not its sigmoid).
"""
from __future__ import annotations

import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.classify_api import activation
from deployments.embeddings_api import PoolingRequest, run_pooling
from deployments.frontend import Frontend
from deployments.openai_api import PromptTooLong
from deployments.protocol import APIError, keep_last
from engine_actors.messages import EngineRequest
from engine_actors.request import SamplingParams


class ScoringRequest(PoolingRequest):
    use_activation: bool | None = None  # vLLM's: null or true, the sigmoid of the logit


# the names of a score request's two sides, as vLLM takes them
SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
         ("data_1", "data_2"))
Texts = str | list[str]


class ScoreRequest(ScoringRequest):
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    def sides(self) -> tuple[str, str]:
        """The names the request gives its two sides under (one pair of SIDES)."""
        given = {name for pair in SIDES for name in pair if getattr(self, name) is not None}
        for pair in SIDES:
            if given == set(pair):
                return pair
        partial = next((pair for pair in SIDES if given & set(pair)), SIDES[0])
        missing = [name for name in partial if name not in given]  # (none: one too many)
        raise APIError(400, "give the two sides of the pairs as text_1 and text_2 (or as "
                            "queries and documents, queries and items, or data_1 and "
                            f"data_2); this request gives {', '.join(sorted(given)) or 'none'}",
                       missing[0] if missing else sorted(given)[-1], "invalid_value")

    def pairs(self) -> list[tuple[str, str]]:
        names = self.sides()
        first, second = ([t] if isinstance(t, str) else t
                         for t in (getattr(self, n) for n in names))
        if not first or not second:
            raise APIError(400, f"{names[0]} and {names[1]} must not be empty",
                           names[0] if not first else names[1], "invalid_value")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise APIError(400, f"{names[0]} has {len(first)} texts and {names[1]} "
                                f"{len(second)}: give one {names[0]}, or as many as "
                                f"{names[1]}", names[1], "invalid_value")
        return list(zip(first, second))


class RerankRequest(ScoringRequest):
    query: str
    documents: list[str]
    top_n: int = 0


class ScoreAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def routes(self) -> list[Route]:
        return [Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")] \
            + [Route(path, self.rerank, methods=["POST"])
               for path in ("/rerank", "/v1/rerank", "/v2/rerank")]

    async def score(self, request: Request):
        try:
            req = await self._parse(request, ScoreRequest)
            scores, num_tokens = await self._scores(req, req.pairs(), req.sides()[1])
            return JSONResponse({
                "id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.frontend.reported_model(req),
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                          "completion_tokens": 0}})
        except APIError as e:
            return e.response()

    async def rerank(self, request: Request):
        try:
            req = await self._parse(request, RerankRequest)
            if not req.documents:
                raise APIError(400, "documents must not be empty", "documents",
                               "invalid_value")
            scores, num_tokens = await self._scores(
                req, [(req.query, d) for d in req.documents], "documents")
            best = sorted(range(len(scores)), key=lambda i: -scores[i])
            best = best[:req.top_n] if req.top_n > 0 else best
            return JSONResponse({
                "id": f"rerank-{uuid.uuid4().hex}", "model": self.frontend.reported_model(req),
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                "results": [{"index": i, "document": {"text": req.documents[i]},
                             "relevance_score": scores[i]} for i in best]})
        except APIError as e:
            return e.response()

    async def _parse(self, request: Request, schema):
        self.frontend.refuse_if_draining()
        req = await self.frontend.parse(request, schema)
        if not (await self.frontend.ready()).scores:
            raise APIError(400, "this server does not score pairs: serve a reranker with "
                                "runner pooling (with classifier_from_token, or a sequence "
                                "classifier of one label)", None, "unsupported_task")
        return req

    async def _scores(self, req, pairs: list[tuple[str, str]], param: str
                      ) -> tuple[list[float], int]:
        """Each pair's score, and the tokens of them all."""
        frontend = self.frontend
        info = await frontend.ready()
        frontend.refuse_over_queue(len(pairs), f"{len(pairs)} pairs", param)
        ids = await frontend.tokenize(lambda t: [t.encode(a + b) for a, b in pairs],
                                      sum(len(a) + len(b) for a, b in pairs))
        limit, n = info.max_model_len, req.truncate_prompt_tokens
        ids = [keep_last(p, limit - 1 if n == limit else n, limit) for p in ids]
        for i, p in enumerate(ids):
            where = f"{param}.{i}" if len(ids) > 1 else param
            if not p:
                raise APIError(400, "a pair of empty texts has no token to score", where,
                               "invalid_value")
            if len(p) >= limit:  # (a pair needs room for its one step)
                raise PromptTooLong(len(p), limit, where)
        base = f"score-{uuid.uuid4().hex}"
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        requests = [EngineRequest(f"{base}-{i}", p, sampling,
                                  req.priority or 0)
                    for i, p in enumerate(ids)]
        logits = np.array([np.frombuffer(s, dtype=np.float32)[0]
                           for s in await run_pooling(frontend, requests, param)], np.float64)
        if not np.isfinite(logits).all():  # (JSON has no NaN)
            raise APIError(500, "the model's score is not a finite number", None,
                           "internal_error", "server_error")
        scores = logits if req.use_activation is False else \
            activation(logits[:, None], info.config.get("problem_type"))[:, 0]
        return scores.tolist(), sum(map(len, ids))
