"""Stored responses of the Responses API, kept in the scheduler actor's memory so that
every ingress replica sees the same ones.

A record is one response's JSON (the response object and the input items of its own
request), stored as a string: its size is exact, and the actor keeps one object per
response rather than a tree of them. A response made with `previous_response_id` links to
that response; its conversation is the chain of records up to it. The store is bounded in
bytes: past `max_bytes` the least recently used records go (reading a chain uses every
record in it, so a conversation in use keeps its history). An evicted or deleted response
is not found, and a conversation that passes through it can not be continued.

A background response is stored as it starts, with the replica that runs it as its owner,
which replaces it as it ends. Until then any replica may cancel it: it is stored as
cancelled and its engine requests end (`abort`: the scheduler tells the owner, whose own
update is then refused); if its owner goes, it is stored as failed. One made with
`stream` also keeps its stream's events, which its owner adds as it runs: any replica
reads them (`events_after`, waiting for new ones), from the start or after one already
seen, while it runs and after it ends. Its stream always ends with its final state (added
here when the response ends otherwise than by its owner's last update: cancelled, failed).
Running responses are never evicted, but their events are bounded with the rest: one whose
next events do not fit beside them fails.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

TOO_LARGE = {"code": "server_error",
             "message": "the response is larger than the response store (response_store_mib)"}
ITEM_BYTES = 160  # what the store keeps per item id beside the record (measured: ~150 + id)
EVENT_BYTES = 400  # and per stream event beside its strings (a dict and two str objects)
# the last event of a stream, by the response's final status (a cancelled one's: an error)
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}


@dataclass(slots=True)
class Record:
    data: str  # JSON: {"response": {...}, "input": [items]}
    previous_id: str | None
    item_ids: list[str]  # the ids of its input and output items
    owner: str | None = None  # a running background response's replica (its client id)
    request_ids: tuple[str, ...] = ()  # and its engine requests
    events: list = field(default_factory=list)  # a streamed background response's events
    event_bytes: int = 0  # theirs: each {"event": its type, "data": its JSON}


class ResponseStore:
    def __init__(self, max_bytes: int, abort: Callable[..., None] = lambda ids, **_: None):
        self.max_bytes = max_bytes
        self._abort = abort  # SchedulerActor.abort
        self.records: OrderedDict[str, Record] = OrderedDict()  # oldest use first
        self.item_owner: dict[str, str] = {}  # item id -> the response that holds it
        self.num_bytes = 0
        self._changed: dict[str, asyncio.Event] = {}  # set when a record changes or goes

    def put(self, response_id: str, data: str, previous_id: str | None, item_ids: list[str],
            owner: str | None = None, request_ids: tuple[str, ...] = (),
            events: list[dict] = ()) -> bool:
        """Keep a response (its item ids are new: no other record has them); False if it
        alone is over the store's size. `owner`: a background response that starts."""
        record = Record(data, previous_id, item_ids, owner, tuple(request_ids), list(events),
                        sum(_event_bytes(e) for e in events))
        if _size(record) > self.max_bytes:
            return False
        self._remove(response_id)
        self.records[response_id] = record
        for item_id in item_ids:
            self.item_owner[item_id] = response_id
        self.num_bytes += _size(record)
        self._evict()
        return True

    def update(self, response_id: str, data: str, item_ids: list[str], owner: str,
               running: bool, events: list[dict] = ()) -> bool:
        """A background response's new state, and its stream's next events, from the
        replica that runs it: False, and nothing stored, once it runs there no more
        (cancelled, failed, deleted)."""
        record = self.records.get(response_id)
        if record is None or record.owner != owner:
            return False
        events = record.events + list(events)
        if events and not running:
            events = _closed(events, json.loads(data)["response"])
        if self.put(response_id, data, record.previous_id, item_ids,
                    owner if running else None, record.request_ids, events):
            return True
        self._end(response_id, "failed", TOO_LARGE)
        return not running  # (a run that cannot be stored stops)

    def cancel(self, response_id: str) -> str | None:
        """Cancel a running background response; the record as it is then (a finished one
        unchanged), or None."""
        record = self._use(response_id)
        if record is not None and record.owner is not None:
            self._abort(list(record.request_ids), cancelled=True)
            self._end(response_id, "cancelled")
        return self.get(response_id)

    def add_events(self, response_id: str, owner: str, events: list[dict]) -> bool:
        """A running background response's next stream events, from its owner; False once
        it runs there no more (and when they no longer fit the store: it failed)."""
        record = self.records.get(response_id)
        if record is None or record.owner != owner:
            return False
        added = sum(_event_bytes(e) for e in events)
        record.event_bytes += added
        self.num_bytes += added
        self._evict()
        if self.num_bytes > self.max_bytes:  # beside the other running ones, it does not fit
            record.event_bytes -= added
            self.num_bytes -= added
            self._end(response_id, "failed", TOO_LARGE)  # (its owner ends its run)
            return False
        record.events += events
        self._notify(response_id)
        return True

    async def events_after(self, response_id: str, after: int, wait_s: float
                           ) -> tuple[list[dict], bool, int] | None:
        """A streamed background response's events after the first `after + 1` (`after`:
        the sequence number of one seen), waiting up to wait_s for some while it runs;
        whether it has ended; how many it has (0: it is not streamed). None if it is not
        stored."""
        clock = asyncio.get_running_loop().time
        deadline = clock() + wait_s
        while True:
            record = self._use(response_id)
            if record is None:
                return None
            if len(record.events) > after + 1 or record.owner is None or not record.events:
                return list(record.events[after + 1:]), record.owner is None, \
                    len(record.events)
            if clock() >= deadline:
                return [], False, len(record.events)
            changed = self._changed.setdefault(response_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), deadline - clock())

    def owner_gone(self, owner: str) -> None:
        """The replica that ran these background responses stopped: they failed."""
        for rid in [rid for rid, r in self.records.items() if r.owner == owner]:
            self._end(rid, "failed", {"code": "server_error", "message": "the server "
                                      "replica that ran this background response stopped"})

    def get(self, response_id: str) -> str | None:
        record = self._use(response_id)
        return record.data if record is not None else None

    def chain(self, response_id: str) -> tuple[list[str], str | None]:
        """The records of a conversation, oldest first, ending with `response_id`'s, and
        None; or ([], the id of the first of them not stored (any more))."""
        chain = []
        rid: str | None = response_id
        while rid is not None:  # ids are new with each record: no cycles
            record = self._use(rid)
            if record is None:
                return [], rid
            chain.append(record.data)
            rid = record.previous_id
        return chain[::-1], None

    def holding(self, item_ids: list[str]) -> dict[str, str]:
        """The records holding these items, by item id (items not stored are left out)."""
        found = {}
        for item_id in item_ids:
            record = self._use(self.item_owner.get(item_id, ""))
            if record is not None:
                found[item_id] = record.data
        return found

    def delete(self, response_id: str) -> bool:
        """Forget a response (a running one ends)."""
        record = self._remove(response_id)
        if record is not None and record.owner is not None:
            self._abort(list(record.request_ids), cancelled=True)
        return record is not None

    def _evict(self) -> None:
        """The least recently used records go until the store fits; running background
        ones stay (a client polls them; their number is bounded by the engine's queue)."""
        while self.num_bytes > self.max_bytes:
            victim = next((rid for rid, r in self.records.items() if r.owner is None), None)
            if victim is None:
                return
            self._remove(victim)

    def _remove(self, response_id: str) -> Record | None:
        record = self.records.pop(response_id, None)
        if record is None:
            return None
        self.num_bytes -= _size(record)
        for item_id in record.item_ids:
            if self.item_owner.get(item_id) == response_id:
                del self.item_owner[item_id]
        self._notify(response_id)
        return record

    def _notify(self, response_id: str) -> None:
        changed = self._changed.pop(response_id, None)
        if changed is not None:
            changed.set()

    def _end(self, response_id: str, status: str, error: dict | None = None) -> None:
        """A running background response ends here, as `status`."""
        record = self.records[response_id]
        stored = json.loads(record.data)
        stored["response"].update(status=status, error=error)
        self.num_bytes -= _size(record)
        record.data, record.owner = json.dumps(stored), None
        if record.events:
            record.events = _closed(record.events, stored["response"])
            record.event_bytes = sum(_event_bytes(e) for e in record.events)
        self.num_bytes += _size(record)
        self._notify(response_id)
        self._evict()

    def stats(self) -> dict:
        return {"stored_responses": len(self.records), "stored_response_bytes": self.num_bytes}

    def _use(self, response_id: str) -> Record | None:
        record = self.records.get(response_id)
        if record is not None:
            self.records.move_to_end(response_id)
        return record


def _size(record: Record) -> int:
    """Bytes counted for a record: its JSON (ASCII), its item ids' bookkeeping and its
    stream's events."""
    return len(record.data) + sum(ITEM_BYTES + len(i) for i in record.item_ids) + \
        record.event_bytes


def _event_bytes(event: dict) -> int:
    return EVENT_BYTES + len(event["data"]) + len(event["event"])


def _closed(events: list[dict], response: dict) -> list[dict]:
    """A streamed response's events, ending with one that gives its final state."""
    if events[-1]["event"] in FINAL_EVENTS.values():
        return events
    kind = FINAL_EVENTS.get(response["status"])
    data = {"type": kind, "sequence_number": len(events), "response": response} if kind \
        else {"type": "error", "sequence_number": len(events), "code": response["status"],
              "message": f"the response was {response['status']}", "param": None}
    return events + [{"event": data["type"], "data": json.dumps(data)}]
