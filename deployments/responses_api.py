"""OpenAI's Responses API: POST /v1/responses, non-streamed and streamed.

The request becomes a chat completion request (responses_protocol.py) and runs through the
chat route's machinery (OpenAIRoutes: template, grammars and tool calls, submission, time
limits, disconnects, metrics); only the output differs: a `response` object, or its
stream of typed events (response_output.py). Finished responses are stored unless the
request says `"store": false` (stored_responses.py); `"background": true` answers at once
and generates in a task (background_responses.py), streamed from the store with `stream`.
With `conversation` (conversations_api.py) the response continues that conversation's
items, and its input and output items are added to it once it has ended.
"""
from __future__ import annotations

import functools
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.background_responses import BackgroundResponses
from deployments.conversations_api import ConversationsAPI
from deployments.openai_api import OpenAIRoutes
from deployments.protocol import APIError
from deployments.response_output import ResponseEvents, ResponseObject
from deployments.responses_items import normalize_input
from deployments.responses_protocol import RESPONSES_PARAMS, ResponsesRequest
from deployments.stored_responses import StoredResponses


class ResponsesAPI:
    def __init__(self, openai: OpenAIRoutes):
        self.openai = openai
        self.frontend = openai.frontend
        self.stored = StoredResponses(self.frontend)
        self.background = BackgroundResponses(openai, self.stored)
        self.conversations = ConversationsAPI(self.frontend, self.stored)

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])] + \
            self.stored.routes() + self.conversations.routes()

    async def create(self, request: Request):
        arrival = time.monotonic()
        conversation, hold = None, f"hold_{uuid.uuid4().hex}"  # (the response's hold on it)
        try:
            req = await self.frontend.parse(request, ResponsesRequest)
            if req.background and not self.stored.is_enabled:
                raise APIError(400, "this server stores no responses (response_store_mib is "
                                    "0), which background responses need", "background",
                               "unsupported_parameter")
            earlier, items = await self.stored.conversation(req.previous_response_id,
                                                            normalize_input(req.input))
            if req.conversation_id is not None:  # (held: released however this ends, also
                conversation = req.conversation_id  # if begin's answer never comes)
                earlier = await self.conversations.begin(conversation, hold)
            chat = req.to_chat(earlier + items)
            info = await self.frontend.ready()
            ids, grammar, parser = await self.openai.chat_prompt(chat, info)
            if req.truncation == "auto" and not fits(req, len(ids), info.max_model_len):
                chat, (ids, grammar, parser) = await self._truncated(
                    req, earlier + items, info) or (chat, (ids, grammar, parser))
            defaults = info.sampling_defaults or {}
            cfg = self.frontend.cfg
            response = ResponseObject(req, self.frontend.reported_model(req),
                                      _pick(req.temperature, defaults, "temperature"),
                                      _pick(req.top_p, defaults, "top_p"),
                                      cfg.block_size if cfg.enable_prefix_caching else None,
                                      is_stored=req.store and self.stored.is_enabled)
            save = self._saving(response, items, conversation, hold)
            group, choices, timeout = await self.openai.submit(
                response.id, chat, [(None, ids)], chat.max_tokens, info, chat=True,
                arrival=arrival, grammar=grammar, tool_parser=parser)
            if req.background:
                events = ResponseEvents(response, background=True) if chat.stream else None
                body = await self.background.start(
                    response, items, group, choices, chat, timeout, events,
                    self._ending(items, conversation, hold))
                conversation = None  # (the background task releases it)
                return await self.stored.stream(response.id) if chat.stream \
                    else JSONResponse(body)
            if chat.stream:
                streamed = self.openai.stream_response(
                    group, choices, ResponseEvents(response, save), chat, timeout)
                if conversation is not None:  # (released at the end, or as the stream closes)
                    streamed.add_on_close(functools.partial(
                        self.conversations.release_soon, conversation, hold))
                    conversation = None
                return streamed
            await self.openai.collect(group, choices, chat, timeout)
            body = response.final(next(iter(choices.values())))
            if save is not None:
                await save(body)
                conversation = None  # (released as its items were added)
            return JSONResponse(body)
        except BaseException as e:
            if conversation is not None:
                self.conversations.release_soon(conversation, hold)
            if not isinstance(e, APIError):
                raise
            # the chat machinery names the chat request's params (in its messages too)
            if e.param in RESPONSES_PARAMS:
                e.message = e.message.replace(e.param, RESPONSES_PARAMS[e.param])
                e.param = RESPONSES_PARAMS[e.param]
            return e.response()

    def _saving(self, response: ResponseObject, items: list[dict], conversation: str | None,
                hold: str):
        """What keeps a response once it has ended (None: nothing): stored, and its input
        and output items added to its conversation (whose hold it releases)."""
        if not response.is_stored and conversation is None:
            return None
        end = self._ending(items, conversation, hold)

        async def save(body: dict) -> None:
            if response.is_stored:
                await self.stored.save(body, items)
            if end is not None:
                await end(body)
        return save

    def _ending(self, items: list[dict], conversation: str | None, hold: str):
        """What ends a response's hold on its conversation, if any: with its final body,
        its input and output items added; with None (it failed), none."""
        if conversation is None:
            return None
        return lambda body: self.conversations.end(
            conversation, hold, [] if body is None else items + body["output"])

    async def _truncated(self, req, items: list[dict], info):
        """truncation "auto" (OpenAI's): the conversation without as few of its first items
        as leave room for the prompt and max_output_tokens (at most half the context), as
        (chat request, chat_prompt's result); None if no cut leaves enough."""
        points = cut_points(items)
        found, lo, hi = None, 0, len(points) - 1
        while lo <= hi:  # (the prompt shrinks as the cut moves on)
            mid = (lo + hi) // 2
            chat = req.to_chat(kept_items(items, points[mid]))
            prompt = await self.openai.chat_prompt(chat, info)
            if fits(req, len(prompt[0]), info.max_model_len):
                found, hi = (chat, prompt), mid - 1
            else:
                lo = mid + 1
        return found


def fits(req, num_prompt_tokens: int, limit: int) -> bool:
    return num_prompt_tokens + min(req.max_output_tokens or 1, limit // 2) <= limit


def cut_points(items: list[dict]) -> list[int]:
    """Where a truncated conversation may start (past its first item): not at a tool
    output, and with every tool output after the cut answering a call after it."""
    points, unanswered = [], set()
    for i in range(len(items) - 1, 0, -1):
        kind = items[i].get("type")
        if kind == "function_call_output":
            unanswered.add(items[i].get("call_id"))
        elif kind == "function_call":
            unanswered.discard(items[i].get("call_id"))
        if not unanswered and kind != "function_call_output":
            points.append(i)
    return points[::-1]


def kept_items(items: list[dict], cut: int) -> list[dict]:
    """The items from `cut` on, after the system and developer messages before it and, when
    the cut is not at a user message, the last user message before it (an agent's task:
    chat templates such as Qwen3's need a user message)."""
    before = [item for item in items[:cut] if _role(item) in ("system", "developer")]
    if _role(items[cut]) != "user":
        before += [item for item in items[:cut] if _role(item) == "user"][-1:]
    return before + items[cut:]


def _role(item: dict) -> str | None:
    return item.get("role") if item.get("type") == "message" else None


def _pick(value: float | None, defaults: dict, name: str) -> float:
    """The value sampling uses: the request's, else the checkpoint's, else OpenAI's (1)."""
    return value if value is not None else defaults.get(name, 1.0)
