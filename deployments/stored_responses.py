"""Stored responses of the Responses API: `store`, `previous_response_id`, `item_reference`
input items (a stored response's items, or a conversation's), and GET /v1/responses/{id}, DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

The records live in the scheduler actor (engine_actors/response_store.py), so every
ingress replica sees the same ones. A record is a response object and the input items of
its own request; a conversation is the chain of records that `previous_response_id` links,
and what a response continues from is every earlier record's input then output items.
Responses are stored when they end (completed, or incomplete); one still generating, or
one that failed, is not found, except background ones, stored as they start (with their
state: background_responses.py), which POST /v1/responses/{id}/cancel cancels; a
conversation continues from one once it has ended. GET /v1/responses/{id}?stream=true
(`starting_after`: the sequence number of the last event seen) streams the events of one
made with `stream` too, live until it ends.
Instructions are not carried over, as in OpenAI's API.
"""
from __future__ import annotations

import contextlib
import json
import logging

from ray.exceptions import TaskCancelledError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.frontend import Frontend
from deployments.list_params import query_limit, query_order
from deployments.protocol import APIError
from deployments.responses import SSEResponse
from deployments.responses_items import new_id
from engine_actors.messages import page

logger = logging.getLogger("orca_serve.ingress")
WAIT_S = 10.0  # how long one call for a stream's next events waits for some


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", None, "not_found",
                    "not_found_error")


def record_items(record: dict) -> list[dict]:
    """A stored response's conversation items: its request's input, then its output."""
    return record["input"] + record["response"]["output"]


def as_record(response: dict, items: list[dict]) -> tuple[str, list[str]]:
    """A response and its request's input items as the store keeps them: (the record's
    JSON, ASCII, so its len is its bytes; the ids of its items)."""
    record = {"response": response, "input": items}
    return json.dumps(record), [item["id"] for item in record_items(record)]


def error_event(sequence_number: int, code: str, message: str) -> dict:
    """A stream's `error` event, when it cannot go on."""
    return {"event": "error", "data": json.dumps({
        "type": "error", "code": code, "message": message, "param": None,
        "sequence_number": sequence_number})}


def starting_after(query) -> int:
    """The sequence number of the last event a client saw (-1: none)."""
    value = query.get("starting_after", "-1")
    if not value.removeprefix("-").isdigit() or int(value) < -1:
        raise APIError(400, f"starting_after must be an integer of at least 0, not {value!r}",
                       "starting_after", "invalid_value")
    return int(value)


class StoredResponses:
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    @property
    def is_enabled(self) -> bool:
        return self.frontend.cfg.response_store_mib > 0

    def routes(self) -> list[Route]:
        one = "/v1/responses/{response_id}"
        return [Route(one, self.retrieve, methods=["GET"]),
                Route(one, self.delete, methods=["DELETE"]),
                Route(one + "/cancel", self.cancel, methods=["POST"]),
                Route(one + "/input_items", self.input_items, methods=["GET"])]

    # ---- used by POST /v1/responses -----------------------------------------------------
    async def conversation(self, previous_id: str | None, items: list[dict]
                           ) -> tuple[list[dict], list[dict]]:
        """What a new response continues from: (its previous response's conversation, its
        inputs then outputs; `items`, the request's input, with item_reference items
        replaced by the stored items they name)."""
        refs = [i for i, item in enumerate(items) if item["type"] == "item_reference"]
        if (previous_id is not None or refs) and not self.is_enabled:
            raise APIError(400, "this server stores no responses (response_store_mib is 0)",
                           "previous_response_id" if previous_id is not None else
                           f"input.{refs[0]}", "unsupported_parameter")
        earlier = []
        if previous_id is not None:
            chain, missing = await self._call("chain", previous_id)
            if missing is not None:
                raise APIError(400, f"Previous response with id {previous_id!r} not found."
                               if missing == previous_id else
                               f"Previous response with id {previous_id!r} can not be "
                               f"continued: response {missing!r}, which it continues, is not "
                               "stored any more.", "previous_response_id",
                               "previous_response_not_found")
            for data in chain:
                record = json.loads(data)
                if record["response"]["status"] in ("queued", "in_progress"):
                    raise APIError(400, f"Response {record['response']['id']!r} is still "
                                        f"{record['response']['status']}: a conversation "
                                        "continues from it once it has ended.",
                                   "previous_response_id", "invalid_value")
                earlier += record_items(record)
        if refs:
            ids = [items[i]["id"] for i in refs]
            found = {item_id: next(item for item in record_items(json.loads(data))
                                   if item["id"] == item_id)
                     for item_id, data in (await self._call("holding", ids)).items()}
            missing = [item_id for item_id in ids if item_id not in found]
            if missing:  # (a conversation's items: conversations_api.py)
                found |= {item_id: json.loads(data) for item_id, data in (
                    await self.frontend.call("conversation_call", "find", missing)).items()}
            items = list(items)
            for i in refs:
                item_id = items[i]["id"]
                if item_id not in found:
                    raise APIError(400, f"Item with id {item_id!r} not found.",
                                   f"input.{i}.id", "item_not_found")
                item = found[item_id]
                # a copy: an id names one stored item
                items[i] = {**item, "id": new_id(item_id.split("_")[0])}
        return earlier, items

    async def save(self, response: dict, items: list[dict]) -> None:
        """Keep a finished response with its request's input items (references resolved).
        If the scheduler is gone, the response is still delivered, and not found later."""
        data, ids = as_record(response, items)
        try:
            if not await self._call("put", response["id"], data,
                                    response["previous_response_id"], ids):
                logger.warning("response %s not stored: over response_store_mib by itself",
                               response["id"])
        except APIError as e:
            logger.warning("response %s not stored: %s", response["id"], e.message)

    async def begin(self, response: dict, items: list[dict], owner: str,
                    request_ids: list[str], events: list[dict]) -> None:
        """Store a background response as it starts, run by this replica (`owner`: its
        engine client's id, which the scheduler drops when the replica goes), with its
        stream's first events if it is streamed."""
        data, ids = as_record(response, items)
        if not await self._call("put", response["id"], data, response["previous_response_id"],
                                ids, owner, request_ids, events):
            raise APIError(400, "the request is larger than this server's response store "
                                "(response_store_mib): it cannot run in the background",
                           "background", "invalid_value")

    async def update(self, response: dict, items: list[dict], owner: str, running: bool,
                     events: list[dict]) -> bool:
        """A background response's new state (and its stream's next events); False once it
        runs here no more (cancelled, deleted, or too large to store). If the scheduler is
        gone, so is the record."""
        data, ids = as_record(response, items)
        return await self._run_call("update", response["id"], data, ids, owner, running,
                                    events)

    async def add_events(self, response_id: str, owner: str, events: list[dict]) -> bool:
        """A streamed background response's next events; False as update."""
        return await self._run_call("add_events", response_id, owner, events)

    async def _run_call(self, method: str, response_id: str, *args) -> bool:
        """A call of the replica running a background response; False if the scheduler is
        gone (and the record with it)."""
        try:
            return await self._call(method, response_id, *args)
        except APIError as e:
            logger.warning("background response %s not updated: %s", response_id, e.message)
            return False

    async def stream(self, response_id: str, after: int = -1) -> SSEResponse:
        """A streamed background response's events after the one numbered `after`, live
        until it ends: the answer to its POST, and to GET ?stream=true from any replica."""
        first = await self._call("events_after", response_id, after, 0.0)
        if first is None:
            raise not_found(response_id)
        if first[2] == 0:
            raise APIError(400, f"Response {response_id!r} was not created with background "
                                "and stream: only those are streamed here", "stream",
                           "invalid_value")

        async def events():
            nonlocal after
            batch, ended, _ = first
            while True:
                for event in batch:
                    yield event
                after += len(batch)
                if ended:
                    return
                try:
                    got = await self._call("events_after", response_id, after, WAIT_S)
                except APIError as e:  # the scheduler is gone, and the record with it
                    yield error_event(after + 1, e.code, e.message)
                    return
                except TaskCancelledError:  # the client left (Serve cancels its calls)
                    return
                if got is None:
                    yield error_event(after + 1, "not_found", f"Response {response_id!r} "
                                      "is not stored any more (deleted, or evicted)")
                    return
                batch, ended, _ = got
        return SSEResponse(events(), on_close=lambda: None)

    async def delete_quietly(self, response_id: str) -> None:
        """Forget a record; if the scheduler is gone, so is the record."""
        with contextlib.suppress(APIError):
            await self._call("delete", response_id)

    # ---- the routes ---------------------------------------------------------------------
    async def retrieve(self, request: Request):
        try:
            response_id = request.path_params["response_id"]
            if request.query_params.get("stream") in ("true", "1"):
                return await self.stream(response_id, starting_after(request.query_params))
            data = await self._call("get", response_id)
            if data is None:
                raise not_found(response_id)
            return JSONResponse(json.loads(data)["response"])
        except APIError as e:
            return e.response()

    async def delete(self, request: Request):
        try:
            response_id = request.path_params["response_id"]
            if not await self._call("delete", response_id):
                raise not_found(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        except APIError as e:
            return e.response()

    async def cancel(self, request: Request):
        """Cancel a background response (one that has ended is returned as it is)."""
        try:
            response_id = request.path_params["response_id"]
            data = await self._call("cancel", response_id)
            if data is None:
                raise not_found(response_id)
            response = json.loads(data)["response"]
            if not response["background"]:
                raise APIError(400, "only a background response can be cancelled", None,
                               "invalid_request")
            return JSONResponse(response)
        except APIError as e:
            return e.response()

    async def input_items(self, request: Request):
        """The items the response was generated from, newest first by default (OpenAI's
        order), a page of `limit` after the item `after`."""
        try:
            response_id = request.path_params["response_id"]
            query = request.query_params
            limit, order = query_limit(query), query_order(query)
            chain, missing = await self._call("chain", response_id)
            if missing is not None:
                raise not_found(response_id) if missing == response_id else APIError(
                    404, f"The input items of response {response_id!r} are not stored any "
                         f"more: response {missing!r}, which it continues, is not.", None,
                    "not_found", "not_found_error")
            records = [json.loads(data) for data in chain]
            items = [item for r in records[:-1] for item in record_items(r)]
            items += records[-1]["input"]
            if order == "desc":
                items.reverse()
            try:
                listed = page(items, query.get("after"), limit)
            except KeyError:
                raise APIError(400, f"after: no item {query['after']!r} in this response's "
                                    "input", "after", "invalid_value") from None
            data = listed["data"]
            return JSONResponse({**listed, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        except APIError as e:
            return e.response()

    async def _call(self, method: str, *args):
        await self.frontend.ready()
        return await self.frontend.call("response_call", method, *args)
