"""The OpenAI-compatible HTTP ingress: a Starlette app inside a Ray Serve deployment.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, and
the background batch endpoints under /orca/v1/batches (deployments/batch_api.py).
The ingress validates and tokenizes, submits to the scheduler actor, and turns the token
stream back into text (incrementally, stop strings included) as JSON or server-sent events.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import ray
from ray import serve
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.batch_api import BatchAPI
from deployments.auth import APIKeyMiddleware
from deployments.engine_client import EngineClient, EngineUnavailable, RequestRefused
from deployments.http_metrics import HTTPMetrics, RequestTimer
from deployments.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                  SamplingFields, parse_body, refusal_error)
from deployments.responses import (Choice, SSEResponse, SSEWriter, deadline_error,
                                   response_body, timeout_error, usage)
from deployments.text_stream import TextStream
from engine_actors.checkpoint import CHAT_TEMPLATE, resolve_model_path
from engine_actors.config import EngineConfig
from engine_actors.request import SamplingParams

logger = logging.getLogger("orca_serve.ingress")
MAX_BODY_BYTES = 4 * 1024 * 1024
HEARTBEAT_LIMIT_S = 15.0  # a scheduler loop silent for longer is stuck
WATCH_S = 1.0  # how often a replica checks whether its application is being deleted


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()
class OpenAIIngress:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.client = EngineClient(cfg)
        self.tokenizer = None
        self.metrics = HTTPMetrics(cfg.model_name)
        self._starting: asyncio.Task | None = None
        self._announced = False
        self._draining = False

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        routes += BatchAPI(self).routes()
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        middleware = [Middleware(APIKeyMiddleware, api_key=self.cfg.api_key)] \
            if self.cfg.api_key else []
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self._lifespan,
                         middleware=middleware)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        loop = asyncio.get_running_loop()
        # Bring the engine up in the background: /health answers 503 until it is ready.
        self._starting = loop.create_task(self._start())
        watcher = loop.create_task(self._watch_for_deletion())
        yield
        watcher.cancel()
        # only this replica goes (scale-down, replacement, or the end of a deletion): its own
        # requests are aborted when it unregisters; the last replica takes the engine along
        self._draining = True
        await self.client.close()

    async def _drain(self, timeout_s: float) -> None:
        """Refuse new requests; running ones get timeout_s, then finish_reason "abort"."""
        self._draining = True
        if self.client.is_connected:
            try:
                await self.client.call("drain", timeout_s)
                await asyncio.sleep(0.2)  # let the aborted streams flush their last event
            except Exception:
                logger.exception("drain failed")

    async def _watch_for_deletion(self) -> None:
        """`serve shutdown` or deleting the app: drain the engine while Serve drains this
        replica (Serve calls the shutdown hook only at the end of its own drain, too late
        to end streams cleanly)."""
        try:
            app_name = serve.get_replica_context().app_name
        except Exception:  # not in a Serve replica
            return
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                status = await asyncio.to_thread(serve.status)
            except Exception:
                continue
            app = status.applications.get(app_name)
            if app is not None and str(app.status).endswith("DELETING"):
                logger.warning("application %s is being deleted: draining", app_name)
                await self._drain(self.cfg.drain_timeout_s)
                return

    # ---- start-up -----------------------------------------------------------------------
    async def _ready(self) -> dict:
        """Connect to (or create) the scheduler and load the tokenizer, once."""
        if self._starting is None or (self._starting.done() and self._starting.exception()):
            self._starting = asyncio.get_running_loop().create_task(self._start())
        try:
            await asyncio.shield(self._starting)
        except EngineUnavailable as e:
            raise APIError(503, f"engine unavailable: {e}", err_type="service_unavailable")
        except Exception as e:
            logger.exception("engine start failed")
            raise APIError(503, f"engine failed to start: {type(e).__name__}",
                           err_type="service_unavailable")
        if not self.client.is_connected:  # the scheduler died since: bring a new one up
            self._starting = None
            return await self._ready()
        return self.client.info

    async def _start(self) -> None:
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
        await self.client.connect()
        if not self._announced:
            self._announced = True
            logger.warning("orca-serve ready: model %s, OpenAI API at %s/v1", self.cfg.model_name,
                           await _http_url())

    def _load_tokenizer(self):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.cfg.model))
        if tokenizer.chat_template is None:
            tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer

    # ---- routes -------------------------------------------------------------------------
    async def health(self, request: Request):
        """200 only while the engine serves: scheduler loop ticking, every worker alive."""
        if self._draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self._starting is None or (self._starting.done() and self._starting.exception()):
            self._starting = asyncio.get_running_loop().create_task(self._start())
        if not (self._starting.done() and self.client.is_connected):
            return JSONResponse({"status": "starting"}, status_code=503)
        try:
            stats = await asyncio.wait_for(self.client.call("health"), timeout=10.0)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        healthy = stats["state"] == "ready" and stats["workers_alive"] \
            and stats["heartbeat_age_s"] < HEARTBEAT_LIMIT_S
        return JSONResponse({"status": "ok" if healthy else stats["state"], **stats},
                            status_code=200 if healthy else 503)

    async def prometheus(self, request: Request):
        """This replica's request metrics, and the engine's (when it is up)."""
        body = self.metrics.render()
        if self.client.is_connected:
            try:
                body += await asyncio.wait_for(self.client.call("metrics_text"), timeout=5.0)
            except Exception:  # the engine's part is missing while it is unavailable
                pass
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request):
        info = await self._ready_or_error()
        if isinstance(info, JSONResponse):
            return info
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "orca-serve",
            "max_model_len": info["max_model_len"]}]})

    async def completions(self, request: Request):
        request.state.arrival = time.monotonic()
        try:
            req = parse_body(await self._body(request), CompletionRequest)
            self._check_model(req)
            info = await self._ready()
            prompts = self._completion_prompts(req.prompt, info)
            return await self._generate(req, prompts, req.max_tokens, info, chat=False,
                                        arrival=request.state.arrival)
        except APIError as e:
            return e.response()

    async def chat_completions(self, request: Request):
        request.state.arrival = time.monotonic()
        try:
            req = parse_body(await self._body(request), ChatCompletionRequest)
            self._check_model(req)
            info = await self._ready()
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)
            except Exception as e:
                raise APIError(400, f"messages could not be formatted: {e}", "messages") from None
            if hasattr(ids, "keys"):  # some tokenizer versions return a BatchEncoding
                ids = ids["input_ids"]
            prompts = [(None, list(ids))]
            return await self._generate(req, prompts, req.max_new_tokens(), info, chat=True,
                                        arrival=request.state.arrival)
        except APIError as e:
            return e.response()

    # ---- helpers ------------------------------------------------------------------------
    async def _ready_or_error(self):
        try:
            return await self._ready()
        except APIError as e:
            return e.response()

    async def _body(self, request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes", None,
                           "request_too_large")
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes", None,
                           "request_too_large")
        return body

    def _check_model(self, req: SamplingFields) -> None:
        if req.model is not None and req.model != self.cfg.model_name:
            raise APIError(404, f"The model `{req.model}` does not exist. This server serves "
                                f"`{self.cfg.model_name}`.", "model", "model_not_found")

    def _completion_prompts(self, prompt, info: dict) -> list[tuple[str | None, list[int]]]:
        """(text, token ids) of each prompt of a completion request."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
        out = []
        for p in prompt:
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=True) if p else []
                text = p
            else:
                if any(not 0 <= t < info["vocab_size"] for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {info['vocab_size']})",
                                   "prompt", "invalid_value")
                ids, text = list(p), None
            if not p or not ids:
                raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
            out.append((text, ids))
        return out

    def _sampling(self, req: SamplingFields, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if req.seed is None else req.seed + choice  # n choices must differ
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                              top_p=req.top_p, top_k=max(req.top_k, 0), seed=seed,
                              ignore_eos=req.ignore_eos)

    async def _generate(self, req, prompts, max_tokens, info, chat: bool, arrival: float):
        limit = info["max_model_len"]
        subs = []  # (request id, prompt index, choice index, prompt text, prompt ids, sampling)
        base_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        for p_idx, (text, ids) in enumerate(prompts):
            if len(ids) >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                                    f"However, your prompt has {len(ids)} tokens.",
                               "messages" if chat else "prompt", "context_length_exceeded")
            n_new = max_tokens if max_tokens is not None else limit - len(ids)
            if len(ids) + n_new > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                                    f"However, you requested {len(ids) + n_new} tokens "
                                    f"({len(ids)} in the prompt, {n_new} for the completion).",
                               "max_tokens", "context_length_exceeded")
            for j in range(req.n):
                rid = f"{base_id}-{p_idx}-{j}"
                subs.append((rid, p_idx * req.n + j, text, ids, self._sampling(req, n_new, j)))
        if self._draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down",
                           "service_unavailable")
        priority = 1 if req.priority is None else req.priority  # interactive by default
        try:
            group = await self.client.submit([(rid, ids, s) for rid, _, _, ids, s in subs],
                                             priority, req.deadline_ms)
        except RequestRefused as e:
            self.metrics.failure(e.code)
            raise refusal_error(e.code, str(e)) from None
        except EngineUnavailable as e:
            self.metrics.failure("engine_unavailable")
            raise APIError(503, str(e), err_type="service_unavailable") from None
        choices = {rid: Choice(index, index // req.n, TextStream(self.tokenizer, req.stop_list()),
                               len(ids), self._echo_text(req, text, ids) if not chat else None,
                               RequestTimer(self.metrics, arrival))
                   for rid, index, text, ids, _ in subs}
        limits = [t for t in (req.timeout_s, self.cfg.request_timeout_s) if t is not None]
        timeout = min(limits) if limits else None  # a request may only shorten the limit
        sse = SSEWriter(base_id, self.cfg.model_name, chat, req) if req.stream else None
        if sse is not None:
            return SSEResponse(self._stream(group, choices, sse, req, timeout),
                               on_close=group.close)
        try:
            async for rid, item in within(group, timeout):
                choice = choices[rid]
                choice.consume(item)
                if choice.text_stream.is_stopped:
                    group.finish(rid)
        except TimeoutError:
            self.metrics.failure("timeout")
            raise timeout_error(timeout) from None
        except EngineUnavailable as e:
            self.metrics.failure("engine_unavailable")
            raise APIError(503, f"request failed: {e}", err_type="service_unavailable") from None
        except asyncio.CancelledError:
            self.metrics.failure("client_disconnect")
            raise
        finally:
            group.close()
        failed = next((c.error for c in choices.values() if c.error), None)
        if failed:
            self.metrics.failure("engine_failure")
            raise APIError(503, f"request failed: {failed}", err_type="service_unavailable")
        if all(c.finish_reason == "deadline" for c in choices.values()):
            raise deadline_error(req.deadline_ms)
        return JSONResponse(response_body(base_id, self.cfg.model_name, chat, choices))

    def _echo_text(self, req, text: str | None, ids: list[int]) -> str | None:
        if not req.echo:
            return None
        return text if text is not None else self.tokenizer.decode(ids)

    async def _stream(self, group, choices, sse: SSEWriter, req, timeout: float | None):
        try:
            if not sse.chat:
                for choice in choices.values():
                    if choice.echo:
                        yield sse.chunk(choice.index, choice.echo, None)
            else:
                for choice in choices.values():
                    yield sse.chunk(choice.index, "", None, role=True)
            # the time limit applies to waiting for the engine, not to writing to the client
            async for rid, item in within(group, timeout):
                choice = choices[rid]
                delta = choice.consume(item)
                if choice.text_stream.is_stopped:
                    group.finish(rid)
                if choice.error:
                    self.metrics.failure("engine_failure")
                    yield sse.error(choice.error)
                    continue
                if delta or choice.finish_reason:
                    yield sse.chunk(choice.index, delta, choice.finish_reason)
                if choice.finish_reason == "deadline":
                    yield sse.error_event(deadline_error(req.deadline_ms))
            if sse.include_usage:
                yield sse.usage(usage(choices))
        except TimeoutError:
            self.metrics.failure("timeout")
            yield sse.error_event(timeout_error(timeout))
        except EngineUnavailable as e:
            self.metrics.failure("engine_unavailable")
            yield sse.error(f"request failed: {e}")
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.failure("client_disconnect")
            raise
        finally:
            group.close()
        yield sse.done()

    async def _http_error(self, request: Request, exc: HTTPException):
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                        None, None, err_type).response()

    async def _internal_error(self, request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal server error", None, "internal_error").response()


async def within(group, timeout_s: float | None):
    """The group's items; TimeoutError once timeout_s have passed in all while waiting."""
    if timeout_s is None:
        async for item in group:
            yield item
        return
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TimeoutError
        try:
            item = await asyncio.wait_for(group.__anext__(), remaining)
        except StopAsyncIteration:
            return
        yield item


async def _http_url() -> str:
    """Where Serve's HTTP proxy listens (asked of the Serve controller), for the ready line."""
    try:
        controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
        http = await controller.get_http_config.remote()
        host = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
        return f"http://{host}:{http.port}"
    except Exception:  # only the log line depends on it
        return "this Serve application's HTTP address"
