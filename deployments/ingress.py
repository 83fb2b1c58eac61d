"""The HTTP ingress: a Starlette app inside a Ray Serve deployment.

Routes: the OpenAI ones (`openai_api.py`; the Responses API, `responses_api.py`), Anthropic's
Messages API (`messages_api.py`), the models
and LoRA adapters (`models_api.py`), vLLM's /tokenize and /detokenize (`tokenize_api.py`),
fine-tuning (`finetune_api.py`), GET /health, GET /metrics, and the background batch
endpoints under /orca/v1/batches (`batch_api.py`). This file holds the deployment itself:
the app, start-up, draining and the operational routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import logging
import uuid

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from deployments.auth import APIKeyMiddleware
from deployments.batch_api import BatchAPI
from deployments.classify_api import ClassifyAPI
from deployments.embeddings_api import EmbeddingsAPI
from deployments.finetune_api import FineTuningAPI
from deployments.frontend import Frontend
from deployments.http_metrics import render_summed
from deployments.messages_api import MessagesAPI
from deployments.models_api import ModelsAPI
from deployments.openai_api import OpenAIRoutes
from deployments.protocol import APIError
from deployments.pooling_api import PoolingAPI
from deployments.responses_api import ResponsesAPI
from deployments.score_api import ScoreAPI
from deployments.serve_run_stop import READY, stop_serve_run
from deployments.tokenize_api import TokenizeAPI
from engine_actors.config import EngineConfig

logger = logging.getLogger("orca_serve.ingress")
HEARTBEAT_LIMIT_S = 15.0  # a scheduler loop silent for longer is stuck
SERVE_CONTROLLER = "SERVE_CONTROLLER_ACTOR"  # Serve's controller, in namespace "serve"
WATCH_S = 2.0  # how often a replica checks whether its application is being deleted
METRICS_PUSH_S = 2.0  # how often a replica hands its request metrics to the scheduler


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()
class OpenAIIngress:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.frontend = Frontend(cfg)
        self.frontend.on_ready = self._announce
        self.frontend.on_failure = self._on_start_failure
        self._ending: asyncio.Task | None = None
        self.replica_id = uuid.uuid4().hex  # keys this replica's request metrics
        self._pushed: list | None = None  # the snapshot the scheduler has
        self._seq = 0  # numbers this replica's snapshots
        self._all_metrics: dict[str, list] = {}  # every replica's, as the scheduler last said
        self._deleting = False  # the application is being deleted
        self._app_is_deleting = None  # asks Serve's controller, once the watcher has it

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/ping", self.health, methods=["GET", "POST"]),  # vLLM's (SageMaker)
                  Route("/version", _version, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        openai = OpenAIRoutes(self.frontend)
        self.responses = ResponsesAPI(openai)
        routes += openai.routes() + self.responses.routes()
        routes += MessagesAPI(openai).routes()
        routes += BatchAPI(self.frontend).routes()
        routes += ModelsAPI(self.frontend).routes() + FineTuningAPI(self.frontend).routes()
        routes += TokenizeAPI(self.frontend).routes() + EmbeddingsAPI(self.frontend).routes()
        routes += ScoreAPI(self.frontend).routes() + ClassifyAPI(self.frontend).routes()
        routes += PoolingAPI(self.frontend).routes()
        # a specific class is handled (and not re-raised) by Starlette's ExceptionMiddleware;
        # `Exception` goes to ServerErrorMiddleware, which logs and re-raises
        handlers = {HTTPException: self._http_error, Exception: self._internal_error,
                    ray.exceptions.TaskCancelledError: self._client_left,
                    ClientDisconnect: self._client_left}
        middleware = [Middleware(APIKeyMiddleware, api_key=self.cfg.api_key)] \
            if self.cfg.api_key else []
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self._lifespan,
                         middleware=middleware)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        # Bring the engine up in the background: /health answers 503 until it is ready.
        self.frontend.start()
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(self._watch_for_deletion())
        pusher = loop.create_task(self._push_metrics())
        yield
        watcher.cancel()
        pusher.cancel()
        await self._push_metrics_once()  # its last requests count in the totals
        if not self._deleting and self._app_is_deleting:  # the watcher polls: ask once more
            with contextlib.suppress(Exception):
                self._deleting = await asyncio.wait_for(self._app_is_deleting(), 2.0)
        # only this replica goes (scale-down, replacement, or the end of a deletion): its own
        # requests are aborted when it unregisters; the last replica takes the engine along
        # (after a grace period for the new replicas of a redeploy, unless it is a deletion)
        self.frontend.is_draining = True
        self.responses.background.close()
        await self.frontend.client.close(final=self._deleting)

    async def _announce(self) -> None:
        # The startup heap (Ray, Starlette, the tokenizer): a full collection took ~100 ms
        # every ~9 s at 116 req/s on llama-8b, a TTFT spike each time; frozen, it is not
        # scanned again.
        gc.collect()
        gc.freeze()
        logger.warning("%smodel %s, OpenAI API at %s/v1", READY, self.cfg.model_name,
                       await _http_url())

    def _on_start_failure(self, cause: str) -> None:
        """The engine cannot start: end a local `serve run`, as vLLM exits. Elsewhere (Serve
        deployed through the dashboard, KubeRay) the failing health check says it."""
        self._ending = asyncio.get_running_loop().create_task(
            asyncio.to_thread(stop_serve_run, cause))

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine cannot start is unhealthy, and
        `serve status` shows why (once `serve run` was told: Serve stops the replica)."""
        if self.frontend.failure is not None and (self._ending is None or self._ending.done()):
            raise RuntimeError(f"the engine failed to start: {self.frontend.failure}")

    async def _drain(self, timeout_s: float) -> None:
        """Refuse new requests; running ones get timeout_s, then finish_reason "abort"."""
        self.frontend.is_draining = True
        if self.frontend.client.is_connected:
            try:
                await self.frontend.client.call("drain", timeout_s)
                await asyncio.sleep(0.2)  # let the aborted streams flush their last event
            except Exception:
                logger.exception("drain failed")

    async def _watch_for_deletion(self) -> None:
        """`serve shutdown` or deleting the app: drain the engine while Serve drains this
        replica (Serve calls the shutdown hook only at the end of its own drain, too late
        to end streams cleanly)."""
        try:
            app_name = serve.get_replica_context().app_name
            controller = ray.get_actor(SERVE_CONTROLLER, namespace="serve")
        except Exception:  # not in a Serve replica
            return
        self._app_is_deleting = lambda: _is_deleting(controller, app_name)
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                deleting = await _is_deleting(controller, app_name)
            except Exception:
                continue
            if deleting:
                self._deleting = True
                logger.warning("application %s is being deleted: draining", app_name)
                await self._drain(self.cfg.drain_timeout_s)
                return

    # ---- routes -------------------------------------------------------------------------
    async def health(self, request: Request):
        """200 only while the engine serves: scheduler loop ticking, every worker alive."""
        if self.frontend.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        self.frontend.start()
        if self.frontend.failure is not None:
            return JSONResponse({"status": "failed", "reason": self.frontend.failure},
                                status_code=503)
        if not self.frontend.is_started:
            return JSONResponse({"status": "starting"}, status_code=503)
        try:
            stats = await asyncio.wait_for(self.frontend.client.call("health"), timeout=10.0)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        healthy = stats["state"] == "ready" and stats["workers_alive"] \
            and stats.get("heartbeat_age_s", 0.0) < HEARTBEAT_LIMIT_S
        return JSONResponse({**stats, "status": "ok" if healthy else stats["state"]},
                            status_code=200 if healthy else 503)

    async def prometheus(self, request: Request):
        """The request metrics of every replica, summed (each replica's latest snapshot, this
        one's taken now), and the engine's (when it is up). While the scheduler cannot be
        reached, the other replicas' figures are the last it gave."""
        client, engine = self.frontend.client, b""
        snapshot = self.frontend.metrics.snapshot()
        self._seq += 1
        every = {**self._all_metrics, self.replica_id: snapshot}
        if client.is_connected:
            replies = await asyncio.gather(*[asyncio.wait_for(call, 5.0) for call in (
                client.call("http_metrics", self.replica_id, self._seq, snapshot),
                client.call("metrics_text"))], return_exceptions=True)
            if not isinstance(replies[0], BaseException):
                every = self._all_metrics = replies[0]
            if not isinstance(replies[1], BaseException):  # missing while the engine is down
                engine = replies[1]
        body = render_summed(list(every.values())) + engine
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def _push_metrics(self) -> None:
        while True:
            await self._push_metrics_once()
            await asyncio.sleep(METRICS_PUSH_S)

    async def _push_metrics_once(self) -> None:
        """Hand this replica's request metrics to the scheduler, if they changed."""
        snapshot = self.frontend.metrics.snapshot()
        if snapshot == self._pushed or not self.frontend.client.is_connected:
            return
        self._seq += 1
        try:
            self._all_metrics = await asyncio.wait_for(self.frontend.client.call(
                "http_metrics", self.replica_id, self._seq, snapshot), 5.0)
            self._pushed = snapshot
        except Exception:  # the engine is unavailable: the next push carries it
            pass

    async def _http_error(self, request: Request, exc: HTTPException):
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                        None, None, err_type).response()

    async def _client_left(self, request: Request, exc: Exception):
        """Serve cancels a request whose client left (and the Ray calls it made), or the
        client left while sending its body."""
        logger.info("client left during %s %s", request.method, request.url.path)
        return Response(status_code=499)

    async def _internal_error(self, request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal server error", None, "internal_error").response()


async def _version(request: Request) -> JSONResponse:
    return JSONResponse({"version": importlib.metadata.version("orca-serve")})


async def _is_deleting(controller, app_name: str) -> bool:
    """Asks the Serve controller for the application's status: one small protobuf
    (`serve.status()` builds every deployment's config, pickling classes: ~7% of a busy
    replica's time when it was polled every second)."""
    from ray.serve.generated.serve_pb2 import ApplicationStatus, StatusOverview
    raw = await controller.get_serve_status.remote(app_name)
    return raw is not None and StatusOverview.FromString(raw).app_status.status == \
        ApplicationStatus.Value("APPLICATION_STATUS_DELETING")


async def _http_url() -> str:
    """Where Serve's HTTP proxy listens (asked of the Serve controller), for the ready line."""
    try:
        controller = ray.get_actor(SERVE_CONTROLLER, namespace="serve")
        http = await controller.get_http_config.remote()
        host = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
        return f"http://{host}:{http.port}"
    except Exception:  # only the log line depends on it
        return "this Serve application's HTTP address"
