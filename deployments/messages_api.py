"""Anthropic's Messages API: POST /v1/messages (non-streamed and streamed) and
POST /v1/messages/count_tokens, as vLLM serves them (Claude Code and Anthropic's SDKs work
with a base URL pointing here).

The request becomes a chat completion request (messages_protocol.py) and runs through the
chat route's machinery (OpenAIRoutes: template, grammars and tool calls, submission, time
limits, disconnects, metrics); only the output differs: a `message` object, or its stream
of events (messages_output.py), and errors in Anthropic's shape.
"""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.messages_output import MessageEvents, MessageObject, error_response
from deployments.messages_content import system_first
from deployments.messages_protocol import CountTokensRequest, MessagesRequest
from deployments.openai_api import OpenAIRoutes, PromptTooLong
from deployments.protocol import APIError

# the chat request's params, as a Messages request names them (in error messages)
MESSAGES_PARAMS = {"response_format": "output_config.format",
                   "continue_final_message": "messages", "stop": "stop_sequences",
                   "thinking_token_budget": "thinking.budget_tokens"}


class MessagesAPI:
    def __init__(self, openai: OpenAIRoutes):
        self.openai = openai
        self.frontend = openai.frontend

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def create(self, request: Request):
        arrival = time.monotonic()
        try:
            req = await self.frontend.parse(request, MessagesRequest)
            chat = req.chat()
            if req.thinking is not None and self.frontend.cfg.reasoning_parser:
                chat.thinking_token_budget = req.thinking.budget_tokens  # (else no thinking)
            info = await self.frontend.ready()
            ids, grammar, parser = await self.prompt(chat, info)
            cfg = self.frontend.cfg
            message = MessageObject(self.frontend.reported_model(req),
                                    cfg.block_size if cfg.enable_prefix_caching else None,
                                    req.max_tokens)
            group, choices, timeout = await self.openai.submit(
                message.id, chat, [(None, ids)], chat.max_tokens, info, chat=True,
                arrival=arrival, grammar=grammar, tool_parser=parser)
            if chat.stream:
                return self.openai.stream_response(group, choices, MessageEvents(message),
                                                   chat, timeout)
            await self.openai.collect(group, choices, chat, timeout)
            return JSONResponse(message.final(next(iter(choices.values()))))
        except APIError as e:
            return error_response(renamed(e))

    async def count_tokens(self, request: Request):
        """{"input_tokens": the prompt's length}, as the chat template renders it."""
        try:
            req = await self.frontend.parse(request, CountTokensRequest)
            await self.frontend.check_served(req)
            info = await self.frontend.ready()
            ids, _, _ = await self.prompt(req.to_chat(), info)
            return JSONResponse({"input_tokens": len(ids)})
        except APIError as e:
            return error_response(renamed(e))

    async def prompt(self, chat, info):
        """The chat prompt (ids, grammar, tool parser). A template that cannot render a
        system message after the first (Claude Code sends them) gets them merged into one
        at the start."""
        try:
            return await self.openai.chat_prompt(chat, info)
        except APIError as e:
            merged = system_first(chat.messages)
            if e.param != "messages" or merged is None:
                raise
        chat.messages = merged
        return await self.openai.chat_prompt(chat, info)


def renamed(e: APIError) -> APIError:
    """The chat machinery names the chat request's params (in its messages too); a prompt
    over the context is worded as Anthropic's (Claude Code compacts the conversation when
    it reads "prompt is too long")."""
    if isinstance(e, PromptTooLong):
        e.message = f"prompt is too long: {e.num_tokens} tokens > {e.limit} maximum"
    if e.param in MESSAGES_PARAMS:
        e.message = e.message.replace(e.param, MESSAGES_PARAMS[e.param])
        e.param = MESSAGES_PARAMS[e.param]
    return e
