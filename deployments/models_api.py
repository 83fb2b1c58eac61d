"""The models a request may name: GET /v1/models and /v1/models/{id} (the base model and
every LoRA adapter, with its `parent`), and vLLM's run-time adapter routes
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
{"lora_name"}. The scheduler actor keeps the adapters, so every replica sees the same."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from deployments.frontend import Frontend, refusal_error
from deployments.protocol import APIError, _Base


class LoadAdapter(_Base):
    lora_name: str
    lora_path: str

    def check_supported(self) -> None:
        pass


class UnloadAdapter(_Base):
    lora_name: str

    def check_supported(self) -> None:
        pass


class ModelsAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.cfg = frontend.cfg
        self.created = int(time.time())  # when this replica started serving the models

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]

    async def _cards(self) -> list[dict]:
        info = await self.frontend.ready()
        base = {"id": self.cfg.model_name, "object": "model", "created": self.created,
                "owned_by": "orca-serve", "root": self.cfg.model, "parent": None,
                "max_model_len": info.max_model_len}
        adapters = await self.frontend.call("adapter_call", "paths") \
            if self.cfg.lora_enabled else {}
        return [{**base, "id": name} for name in self.cfg.model_names] + \
            [{**base, "id": name, "root": path, "parent": self.cfg.model_name}
             for name, path in sorted(adapters.items())]

    async def models(self, request: Request):
        try:
            return JSONResponse({"object": "list", "data": await self._cards()})
        except APIError as e:
            return e.response()

    async def model(self, request: Request):
        """GET /v1/models/{id}: the model card, or 404 as OpenAI answers."""
        name = request.path_params["model"]
        try:
            card = next((c for c in await self._cards() if c["id"] == name), None)
            if card is None:
                raise APIError(404, f"The model `{name}` does not exist.", "model",
                               "model_not_found", "not_found_error")
            return JSONResponse(card)
        except APIError as e:
            return e.response()

    async def load(self, request: Request):
        try:
            body = await self.frontend.parse(request, LoadAdapter)
            await self.frontend.ready()
            refusal = await self.frontend.call("adapter_call", "load", body.lora_name,
                                               body.lora_path)
            if refusal is not None:
                raise refusal_error(refusal.code, refusal.message, "lora_path")
        except APIError as e:
            return e.response()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: Request):
        try:
            body = await self.frontend.parse(request, UnloadAdapter)
            await self.frontend.ready()
            refusal = await self.frontend.call("adapter_call", "unload", body.lora_name)
            if refusal is not None:
                error = refusal_error(refusal.code, refusal.message)
                error.param = "lora_name"  # (not the request's model)
                raise error
        except APIError as e:
            return e.response()
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
