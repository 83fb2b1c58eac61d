"""Stored responses of the Responses API, kept in the scheduler actor's memory so that
every ingress replica sees the same ones.

A record is one response's JSON (the response object and the input items of its own
request), stored as a string: its size is exact, and the actor keeps one object per
response rather than a tree of them. A response made with `previous_response_id` links to
that response; its conversation is the chain of records up to it. The store is bounded in
bytes: past `max_bytes` the least recently used records go (reading a chain uses every
record in it, so a conversation in use keeps its history). An evicted or deleted response
is not found, and a conversation that passes through it can not be continued.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

ITEM_BYTES = 160  # what the store keeps per item id beside the record (measured: ~150 + id)


@dataclass(slots=True)
class Record:
    data: str  # JSON: {"response": {...}, "input": [items]}
    previous_id: str | None
    item_ids: list[str]  # the ids of its input and output items


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.records: OrderedDict[str, Record] = OrderedDict()  # oldest use first
        self.item_owner: dict[str, str] = {}  # item id -> the response that holds it
        self.num_bytes = 0

    def put(self, response_id: str, data: str, previous_id: str | None,
            item_ids: list[str]) -> bool:
        """Keep a response (its item ids are new: no other record has them); False if it
        alone is over the store's size."""
        record = Record(data, previous_id, item_ids)
        if _size(record) > self.max_bytes:
            return False
        self.delete(response_id)
        self.records[response_id] = record
        for item_id in item_ids:
            self.item_owner[item_id] = response_id
        self.num_bytes += _size(record)
        while self.num_bytes > self.max_bytes:
            self.delete(next(iter(self.records)))
        return True

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
        record = self.records.pop(response_id, None)
        if record is None:
            return False
        self.num_bytes -= _size(record)
        for item_id in record.item_ids:
            if self.item_owner.get(item_id) == response_id:
                del self.item_owner[item_id]
        return True

    def stats(self) -> dict:
        return {"stored_responses": len(self.records), "stored_response_bytes": self.num_bytes}

    def _use(self, response_id: str) -> Record | None:
        record = self.records.get(response_id)
        if record is not None:
            self.records.move_to_end(response_id)
        return record


def _size(record: Record) -> int:
    """Bytes counted for a record: its JSON (ASCII) and its item ids' bookkeeping."""
    return len(record.data) + sum(ITEM_BYTES + len(i) for i in record.item_ids)
