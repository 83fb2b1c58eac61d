"""Native endpoints for background batches (FineInfer's batching mode).

    POST   /orca/v1/batches               submit; answers at once with the batch's status
    GET    /orca/v1/batches/{id}          status: in_progress | completed | cancelled | failed
    GET    /orca/v1/batches/{id}/results  server-sent events, one per finished request
    DELETE /orca/v1/batches/{id}          cancel what has not finished

A batch is scheduled request by request at its priority (default 0, below interactive
requests' 1), not as a block, and lives in the scheduler actor, so any ingress replica can
answer for it. Texts are decoded here from the token ids the scheduler kept; stop strings
cut the text (and the token count) at the first match.
"""
from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.engine_client import EngineUnavailable
from deployments.protocol import APIError, BatchSubmit, parse_body, refusal_error
from deployments.responses import SSEResponse
from deployments.text_stream import TextStream
from engine_actors.request import SamplingParams


class BatchAPI:
    def __init__(self, ingress):
        self.ingress = ingress  # its tokenizer, engine client, model check and body limits

    def routes(self) -> list[Route]:
        return [Route("/orca/v1/batches", self.submit, methods=["POST"]),
                Route("/orca/v1/batches/{batch_id}", self.status, methods=["GET"]),
                Route("/orca/v1/batches/{batch_id}", self.cancel, methods=["DELETE"]),
                Route("/orca/v1/batches/{batch_id}/results", self.results, methods=["GET"])]

    async def submit(self, request: Request):
        ingress = self.ingress
        try:
            body = parse_body(await ingress._body(request), BatchSubmit)
            ingress._check_model(body)
            info = await ingress._ready()
            limit = info["max_model_len"]
            requests = []
            for i, item in enumerate(body.requests):
                ids = self._tokens(item.prompt, info, f"requests.{i}.prompt")
                if len(ids) + item.max_tokens > limit:
                    raise APIError(400, f"request {i}: prompt ({len(ids)} tokens) + max_tokens "
                                        f"({item.max_tokens}) exceeds the context length {limit}",
                                   f"requests.{i}.max_tokens", "context_length_exceeded")
                sampling = SamplingParams(max_tokens=item.max_tokens,
                                          temperature=item.temperature, top_p=item.top_p,
                                          top_k=max(item.top_k, 0), seed=item.seed,
                                          ignore_eos=item.ignore_eos)
                requests.append((ids, sampling, item.deadline_ms, item.stop_list()))
            batch_id = "batch-" + uuid.uuid4().hex
            refusal = await ingress.client.call("submit_batch", batch_id, requests,
                                                body.priority)
            if refusal is not None:
                raise refusal_error(refusal["code"], refusal["message"], "requests")
            return JSONResponse(await ingress.client.call("batch_status", batch_id))
        except EngineUnavailable as e:
            return APIError(503, str(e), err_type="service_unavailable").response()
        except APIError as e:
            return e.response()

    async def status(self, request: Request):
        return await self._by_id(request, "batch_status")

    async def cancel(self, request: Request):
        return await self._by_id(request, "cancel_batch")

    async def results(self, request: Request):
        batch_id = request.path_params["batch_id"]
        try:
            await self.ingress._ready()
            if await self.ingress.client.call("batch_status", batch_id) is None:
                raise _not_found(batch_id)
        except EngineUnavailable as e:
            return APIError(503, str(e), err_type="service_unavailable").response()
        except APIError as e:
            return e.response()
        return SSEResponse(self._events(batch_id), on_close=lambda: None)

    async def _events(self, batch_id: str):
        try:
            async for results in self.ingress.client.stream_call("batch_results", batch_id):
                for r in results:
                    yield f"data: {json.dumps(self._result(batch_id, r))}\n\n"
        except EngineUnavailable as e:
            error = APIError(503, f"batch results unavailable: {e}",
                             err_type="service_unavailable")
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    def _result(self, batch_id: str, r: dict) -> dict:
        text = TextStream(self.ingress.tokenizer, r["stop"])
        out = text.add(r["token_ids"], is_final=True)
        finish = "stop" if text.is_stopped else r["finish_reason"]
        error = None
        if r["error"] and finish == "abort":
            error = APIError(409, r["error"], None, "cancelled", "cancelled").body()
        elif r["error"]:
            error = APIError(408 if finish == "deadline" else 503, r["error"],
                             code="deadline_exceeded" if finish == "deadline" else None).body()
        used = text.num_tokens_used
        return {"batch_id": batch_id, "index": r["index"], "text": out, "finish_reason": finish,
                "usage": {"prompt_tokens": r["num_prompt_tokens"], "completion_tokens": used,
                          "total_tokens": r["num_prompt_tokens"] + used},
                "error": error}

    async def _by_id(self, request: Request, method: str):
        batch_id = request.path_params["batch_id"]
        try:
            await self.ingress._ready()
            status = await self.ingress.client.call(method, batch_id)
        except EngineUnavailable as e:
            return APIError(503, str(e), err_type="service_unavailable").response()
        except APIError as e:
            return e.response()
        if status is None:
            return _not_found(batch_id).response()
        return JSONResponse(status)

    def _tokens(self, prompt, info: dict, param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.ingress.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        else:
            ids = list(prompt)
            if any(not 0 <= t < info["vocab_size"] for t in ids):
                raise APIError(400, f"token ids must be in [0, {info['vocab_size']})", param,
                               "invalid_value")
        if not ids:
            raise APIError(400, "prompt must not be empty", param, "invalid_value")
        return ids


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"no batch {batch_id!r} (unknown, or expired)", "batch_id",
                    "batch_not_found", "not_found_error")
