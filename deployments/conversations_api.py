"""OpenAI's Conversations API: POST /v1/conversations, GET, POST (metadata) and DELETE
/v1/conversations/{id}, GET and POST /v1/conversations/{id}/items, GET and DELETE
/v1/conversations/{id}/items/{item_id}; and what POST /v1/responses with `conversation`
needs (responses_api.py): the conversation's items before its input, and its input and
output items added once it has ended. The response holds the conversation meanwhile
(conversation_store.py): another one on it is a 400 with code `conversation_locked`. The
replica renews the holds of its running responses every RENEW_S, so a response may run
longer than the store's LOCK_S; a replica that dies leaves holds that lapse.

Conversations live in the scheduler actor (engine_actors/conversation_store.py), so every
ingress replica sees the same ones. Items are the Responses API's input items (messages,
function calls and their outputs, reasoning: responses_items.normalize_input), each given a
new id as it is added.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.frontend import Frontend
from deployments.list_params import query_limit, query_order
from deployments.protocol import APIError, _Base
from deployments.responses_items import normalize_input
from engine_actors.messages import page

logger = logging.getLogger("orca_serve.ingress")
MAX_NEW_ITEMS = 20  # OpenAI's: items in one create call
RENEW_S = 120.0  # how often a replica renews its running responses' holds (LOCK_S: 600)
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class CreateConversation(_Base):
    items: list | None = None
    metadata: Metadata | None = None


class UpdateConversation(_Base):
    metadata: Metadata | None  # (required: the client sends null to clear it)


class AddItems(_Base):
    items: list


def not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Conversation with id {conversation_id!r} not found.", param,
                    "not_found", "not_found_error")


async def new_items(items: list, stored) -> list[tuple[str, str]]:
    """Input items as the store keeps them ((id, JSON) each): checked and given new ids,
    item_reference items replaced by copies of the stored items they name (`stored`:
    stored_responses.StoredResponses); an error names the item by its index in `items`."""
    if len(items) > MAX_NEW_ITEMS:
        raise APIError(400, f"at most {MAX_NEW_ITEMS} items may be added at once, not "
                            f"{len(items)}", "items", "invalid_value")
    try:
        _, normalized = await stored.conversation(None, normalize_input(items))
    except APIError as e:
        if e.param and e.param.startswith("input."):
            e.message = e.message.replace("input.", "items.", 1)
            e.param = "items" + e.param.removeprefix("input")
        raise
    return [(item["id"], json.dumps(item)) for item in normalized]


class ConversationsAPI:
    def __init__(self, frontend: Frontend, stored):
        self.frontend = frontend
        self.stored = stored  # stored_responses.StoredResponses: item references
        self._tasks: set[asyncio.Task] = set()  # releases under way, kept alive
        self._held: set[tuple[str, str]] = set()  # (conversation, response) holds begun here
        self._renewing: asyncio.Task | None = None

    def routes(self) -> list[Route]:
        one, item = "/v1/conversations/{conversation_id}", "/items/{item_id}"
        return [Route("/v1/conversations", self.create, methods=["POST"]),
                Route(one, self.retrieve, methods=["GET"]),
                Route(one, self.update, methods=["POST"]),
                Route(one, self.delete, methods=["DELETE"]),
                Route(one + "/items", self.list_items, methods=["GET"]),
                Route(one + "/items", self.add_items, methods=["POST"]),
                Route(one + item, self.retrieve_item, methods=["GET"]),
                Route(one + item, self.delete_item, methods=["DELETE"])]

    # ---- used by POST /v1/responses -----------------------------------------------------
    async def begin(self, conversation_id: str, token: str) -> list[dict]:
        """The conversation's items, oldest first, held for response `token` until `end`
        (400 naming `conversation` if it is not found or another response holds it)."""
        items = await self._call("begin", conversation_id, token, time.time())
        if items is None:
            raise APIError(400, f"Conversation with id {conversation_id!r} not found.",
                           "conversation", "invalid_value")
        if items is False:
            raise APIError(400, f"Another response is running on conversation "
                                f"{conversation_id!r}; send this one once it has ended.",
                           "conversation", "conversation_locked")
        self._held.add((conversation_id, token))
        if self._renewing is None or self._renewing.done():  # (out of the request's context)
            self._renewing = asyncio.get_running_loop().create_task(
                self._renew_holds(), context=contextvars.Context())
        return [json.loads(item) for item in items]

    async def _renew_holds(self) -> None:
        """Every RENEW_S while this replica holds conversations: renew each hold (one that
        the store no longer has, ended or lapsed, is forgotten)."""
        while self._held:
            await asyncio.sleep(RENEW_S)
            for hold in list(self._held):
                try:
                    if not await self._call("renew", *hold, time.time()):
                        self._held.discard(hold)
                except Exception as e:  # (the scheduler restarting: try again later)
                    logger.warning("conversation %s: its hold not renewed (%s)", hold[0], e)

    async def end(self, conversation_id: str, token: str, items: list[dict]) -> None:
        """Response `token` has ended: its input and output items added (none: it failed)
        and its hold released. If the conversation is gone (deleted, evicted) or the
        scheduler is, the response is still delivered."""
        self._held.discard((conversation_id, token))
        try:
            added = await self._call("end", conversation_id, token,
                                     [(item["id"], json.dumps(item)) for item in items])
        except APIError as e:
            added = e.message
        if added is not True:
            logger.warning("conversation %s: a response's items not added (%s)",
                           conversation_id, "not found" if added is None else
                           "over response_store_mib by itself" if added is False else added)

    def release_soon(self, conversation_id: str, token: str) -> None:
        """`end` with no items, in a task of its own context (the request's may be gone:
        Serve cancels the Ray calls made in it when its client leaves). A hold already
        released (the response ended) stays released."""
        task = asyncio.get_running_loop().create_task(
            self.end(conversation_id, token, []), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the routes ---------------------------------------------------------------------
    async def create(self, request: Request):
        try:
            req = await self.frontend.parse(request, CreateConversation)
            items = await new_items(req.items or [], self.stored)
            conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation",
                            "created_at": int(time.time()), "metadata": req.metadata or {}}
            if not await self._call("create", conversation["id"], json.dumps(conversation),
                                    items):
                raise APIError(400, "the conversation is larger than this server's "
                                    "conversation store (response_store_mib)", "items",
                               "invalid_value")
            return JSONResponse(conversation)
        except APIError as e:
            return e.response()

    async def retrieve(self, request: Request):
        try:
            return JSONResponse(await self._conversation(request))
        except APIError as e:
            return e.response()

    async def update(self, request: Request):
        try:
            req = await self.frontend.parse(request, UpdateConversation)
            conversation = {**await self._conversation(request),
                            "metadata": req.metadata or {}}
            if not await self._call("update", conversation["id"], json.dumps(conversation)):
                raise not_found(conversation["id"])
            return JSONResponse(conversation)
        except APIError as e:
            return e.response()

    async def delete(self, request: Request):
        try:
            conversation_id = request.path_params["conversation_id"]
            if not await self._call("delete", conversation_id):
                raise not_found(conversation_id)
            return JSONResponse({"id": conversation_id, "object": "conversation.deleted",
                                 "deleted": True})
        except APIError as e:
            return e.response()

    async def list_items(self, request: Request):
        """A page of `limit` items after the item `after`, newest first by default."""
        try:
            conversation_id = request.path_params["conversation_id"]
            query = request.query_params
            limit, order = query_limit(query), query_order(query)
            items = await self._call("items", conversation_id)
            if items is None:
                raise not_found(conversation_id)
            items = [json.loads(item) for item in items]
            return JSONResponse(listed(items[::-1] if order == "desc" else items,
                                       query.get("after"), limit))
        except APIError as e:
            return e.response()

    async def add_items(self, request: Request):
        try:
            conversation_id = request.path_params["conversation_id"]
            req = await self.frontend.parse(request, AddItems)
            items = await new_items(req.items, self.stored)
            added = await self._call("add", conversation_id, items)
            if added is None:
                raise not_found(conversation_id)
            if not added:
                raise APIError(400, "the conversation would be larger than this server's "
                                    "conversation store (response_store_mib)", "items",
                               "invalid_value")
            data = [json.loads(item) for _, item in items]
            return JSONResponse({"object": "list", "data": data, "has_more": False,
                                 "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        except APIError as e:
            return e.response()

    async def retrieve_item(self, request: Request):
        try:
            return JSONResponse(json.loads((await self._item(request, "item"))[1]))
        except APIError as e:
            return e.response()

    async def delete_item(self, request: Request):
        """The item removed; the answer is the conversation (OpenAI's)."""
        try:
            return JSONResponse(json.loads((await self._item(request, "delete_item"))[0]))
        except APIError as e:
            return e.response()

    async def _item(self, request: Request, method: str):
        """The store's `method` on the item the path names: (the conversation's JSON, the
        item's JSON or whether it was deleted); APIError 404 if either is not found."""
        conversation_id, item_id = (request.path_params[k] for k in ("conversation_id",
                                                                      "item_id"))
        conversation, item = await self._call(method, conversation_id, item_id)
        if conversation is None:
            raise not_found(conversation_id)
        if not item:
            raise APIError(404, f"Item with id {item_id!r} not found.", None, "not_found",
                           "not_found_error")
        return conversation, item

    async def _conversation(self, request: Request) -> dict:
        conversation_id = request.path_params["conversation_id"]
        data = await self._call("get", conversation_id)
        if data is None:
            raise not_found(conversation_id)
        return json.loads(data)

    async def _call(self, method: str, *args):
        if self.frontend.cfg.response_store_mib <= 0:
            raise APIError(400, "this server stores no conversations (response_store_mib is "
                                "0)", None, "unsupported_parameter")
        await self.frontend.ready()
        return await self.frontend.call("conversation_call", method, *args)


def listed(items: list[dict], after: str | None, limit: int) -> dict:
    """OpenAI's list object of items (engine_actors.messages.page) with first and last ids."""
    try:
        result = page(items, after, limit)
    except KeyError:
        raise APIError(400, f"after: no item {after!r} in this conversation", "after",
                       "invalid_value") from None
    data = result["data"]
    return {**result, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
