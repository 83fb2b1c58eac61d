"""vLLM's token routes, for tools that count tokens or check a prompt against the context
before they send it: POST /tokenize {"prompt"} or {"messages"} (rendered by the chat
template, as /v1/chat/completions renders them) and POST /detokenize {"tokens"}."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.chat_protocol import ChatMessage, Tool, check_template_kwargs
from deployments.frontend import Frontend
from deployments.protocol import APIError, _Base


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as on chat completions
    add_special_tokens: bool | None = None  # vLLM's defaults: prompt true, messages false
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # as on chat completions

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt", "invalid_value")
        check_template_kwargs(self.chat_template_kwargs)
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false",
                           "continue_final_message", "invalid_value")
        for i, m in enumerate(self.messages or []):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                part.check_supported(f"messages.{i}.content.{j}")


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


class TokenizeAPI:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def tokenize(self, request: Request):
        try:
            req = await self.frontend.parse(request, TokenizeRequest)
            info = await self.frontend.ready()
            await self.frontend.check_served(req)
            if req.prompt is not None:
                special = req.add_special_tokens is not False
                ids = await self.frontend.tokenize(
                    lambda t: t.encode(req.prompt, add_special_tokens=special), len(req.prompt))
            else:
                ids = await self.frontend.chat_ids(req.messages, req.tools,
                                                   req.add_generation_prompt,
                                                   bool(req.add_special_tokens),
                                                   req.chat_template_kwargs,
                                                   req.continue_final_message,
                                                   template=self.frontend.request_template(
                                                       req.chat_template))
            body = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                    "token_strs": self.frontend.tokenizer.convert_ids_to_tokens(ids)
                    if req.return_token_strs else None}
            return JSONResponse(body)
        except APIError as e:
            return e.response()

    async def detokenize(self, request: Request):
        try:
            req = await self.frontend.parse(request, DetokenizeRequest)
            info = await self.frontend.ready()
            await self.frontend.check_served(req)
            if any(not 0 <= t < info.vocab_size for t in req.tokens):
                raise APIError(400, f"tokens must be token ids in [0, {info.vocab_size})",
                               "tokens", "invalid_value")
            return JSONResponse({"prompt": await self.frontend.tokenize(
                lambda t: t.decode(req.tokens), len(req.tokens))})
        except APIError as e:
            return e.response()
