"""Native endpoints for background batches (FineInfer's batching mode).

    POST   /orca/v1/batches               submit; answers at once with the batch's status
    GET    /orca/v1/batches/{id}          status: in_progress | completed | cancelled | failed
    GET    /orca/v1/batches/{id}/results  server-sent events, one per finished request
    DELETE /orca/v1/batches/{id}          cancel what has not finished

A batch is scheduled request by request at its priority (default 1, after interactive
requests' 0: lower runs first, as in vLLM), not as a block, and lives in the scheduler
actor, so any ingress replica can answer for it. Requests are validated as the OpenAI
routes validate theirs (`Frontend`). Texts are decoded here from the token ids the
scheduler kept; a request with stop strings was ended there at the first match.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid

import ray
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.engine_client import EngineUnavailable
from deployments.frontend import Frontend, refusal_error
from deployments.batch_protocol import BatchSubmit
from deployments.protocol import APIError
from deployments.responses import SSEResponse
from engine_actors.detokenizer import TextStream
from engine_actors.messages import BatchRequest, BatchResult

logger = logging.getLogger("orca_serve.ingress")


class BatchAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def routes(self) -> list[Route]:
        return [Route("/orca/v1/batches", self.submit, methods=["POST"]),
                Route("/orca/v1/batches/{batch_id}", self.status, methods=["GET"]),
                Route("/orca/v1/batches/{batch_id}", self.cancel, methods=["DELETE"]),
                Route("/orca/v1/batches/{batch_id}/results", self.results, methods=["GET"])]

    async def submit(self, request: Request):
        frontend = self.frontend
        try:
            body = await frontend.parse(request, BatchSubmit)
            info = await frontend.ready()
            limit = info.max_model_len
            frontend.refuse_over_queue(len(body.requests), f"{len(body.requests)} requests",
                                       "requests", frontend.cfg.data_parallel_size)
            requests = []
            all_ids = await frontend.prompt_ids(
                [item.prompt for item in body.requests], info,
                [f"requests.{i}.prompt" for i in range(len(body.requests))])
            for i, (item, ids) in enumerate(zip(body.requests, all_ids)):
                if len(ids) + item.max_tokens > limit:
                    raise APIError(400, f"request {i}: prompt ({len(ids)} tokens) + max_tokens "
                                        f"({item.max_tokens}) exceeds the context length {limit}",
                                   f"requests.{i}.max_tokens", "context_length_exceeded")
                try:
                    sampling = item.sampling_params(item.max_tokens, 0, info.sampling_defaults,
                                                    info.vocab_size)
                except APIError as e:  # named within the body, as pydantic's errors are
                    e.param = f"requests.{i}.{e.param}"
                    raise
                requests.append(BatchRequest(ids, sampling, item.deadline_ms, item.stop_list(),
                                             frontend.adapter(body)))
            frontend.refuse_if_draining()
            batch_id = "batch-" + uuid.uuid4().hex
            refusal = await frontend.call("submit_batch", batch_id, requests, body.priority)
            if refusal is not None:
                raise refusal_error(refusal.code, refusal.message, "requests")
            return JSONResponse(await frontend.call("batch_call", "status", batch_id))
        except APIError as e:
            return e.response()

    async def status(self, request: Request):
        return await self._by_id(request, "status")

    async def cancel(self, request: Request):
        return await self._by_id(request, "cancel")

    async def results(self, request: Request):
        batch_id = request.path_params["batch_id"]
        try:
            await self.frontend.ready()
            if await self.frontend.call("batch_call", "status", batch_id) is None:
                raise _not_found(batch_id)
        except APIError as e:
            return e.response()
        return SSEResponse(self._events(batch_id), on_close=lambda: None)

    async def _events(self, batch_id: str):
        try:
            async for results in self.frontend.client.stream_call("batch_results", batch_id):
                for r in results:
                    yield json.dumps(self._result(batch_id, r))
        except EngineUnavailable as e:
            error = APIError(503, f"batch results unavailable: {e}",
                             err_type="service_unavailable")
            yield json.dumps(error.body())
        except (asyncio.CancelledError, ray.exceptions.TaskCancelledError):
            # the client left: Serve cancels this request and the Ray calls it made
            logger.info("results reader of %s left", batch_id)
            return
        yield "[DONE]"

    def _result(self, batch_id: str, r: BatchResult) -> dict:
        text = TextStream(self.frontend.tokenizer, r.stop)
        out = text.add(r.token_ids, is_final=True)
        error = None
        if r.error and r.finish_reason == "abort":
            error = APIError(409, r.error, None, "cancelled", "cancelled").body()
        elif r.error:
            deadline = r.finish_reason == "deadline"
            error = APIError(408 if deadline else 503, r.error,
                             code="deadline_exceeded" if deadline else None).body()
        used = text.num_tokens_used
        return {"batch_id": batch_id, "index": r.index, "text": out,
                "finish_reason": r.finish_reason,
                "usage": {"prompt_tokens": r.num_prompt_tokens, "completion_tokens": used,
                          "total_tokens": r.num_prompt_tokens + used,
                          "prompt_tokens_details": {"cached_tokens": r.num_cached_tokens}},
                "error": error}

    async def _by_id(self, request: Request, method: str):
        batch_id = request.path_params["batch_id"]
        try:
            await self.frontend.ready()
            status = await self.frontend.call("batch_call", method, batch_id)
        except APIError as e:
            return e.response()
        if status is None:
            return _not_found(batch_id).response()
        return JSONResponse(status)


def _not_found(batch_id: str) -> APIError:
    return APIError(404, f"no batch {batch_id!r} (unknown, or expired)", "batch_id",
                    "batch_not_found", "not_found_error")
