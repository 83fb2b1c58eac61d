"""Conversations of OpenAI's Conversations API, kept in the scheduler actor's memory beside
the stored responses (response_store.py), so that every ingress replica sees the same ones.

A conversation is its object's JSON (id, created_at, metadata) and its items' JSON in
order, each a string: their sizes are exact. The store is bounded in bytes (the server's
response_store_mib, a budget of its own): past it the least recently used conversations
go whole, never the one being written. A conversation or item evicted or deleted is not
found.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

CONVERSATION_BYTES = 400  # beside its strings: the record, its dicts (measured roughly)
ITEM_BYTES = 160  # per item beside its string: its id and the dict entry


@dataclass(slots=True)
class Conversation:
    data: str  # the conversation object's JSON
    items: OrderedDict[str, str] = field(default_factory=OrderedDict)  # id -> item JSON

    @property
    def num_bytes(self) -> int:
        return CONVERSATION_BYTES + len(self.data) + sum(
            ITEM_BYTES + len(item_id) + len(item) for item_id, item in self.items.items())


class ConversationStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.conversations: OrderedDict[str, Conversation] = OrderedDict()  # oldest use first
        self.num_bytes = 0

    def create(self, conversation_id: str, data: str, items: list[tuple[str, str]]) -> bool:
        """A new conversation with its first items ((id, JSON) each); False if it alone is
        over the budget."""
        conversation = Conversation(data, OrderedDict(items))
        if conversation.num_bytes > self.max_bytes:
            return False
        self.conversations[conversation_id] = conversation
        self._grew(conversation_id, conversation.num_bytes)
        return True

    def get(self, conversation_id: str) -> str | None:
        conversation = self._use(conversation_id)
        return None if conversation is None else conversation.data

    def update(self, conversation_id: str, data: str) -> bool:
        """The conversation's object replaced (new metadata); False if it is not found."""
        conversation = self._use(conversation_id)
        if conversation is None:
            return False
        self.num_bytes += len(data) - len(conversation.data)
        conversation.data = data
        self._grew(conversation_id, 0)
        return True

    def delete(self, conversation_id: str) -> bool:
        conversation = self.conversations.pop(conversation_id, None)
        if conversation is not None:
            self.num_bytes -= conversation.num_bytes
        return conversation is not None

    def add(self, conversation_id: str, items: list[tuple[str, str]]) -> bool | None:
        """Items appended to the conversation; None if it is not found, False if it would be
        over the budget by itself (nothing is added then)."""
        conversation = self._use(conversation_id)
        if conversation is None:
            return None
        before = conversation.num_bytes
        grown = Conversation(conversation.data, OrderedDict([*conversation.items.items(),
                                                             *items]))
        if grown.num_bytes > self.max_bytes:
            return False
        self.conversations[conversation_id] = grown
        self._grew(conversation_id, grown.num_bytes - before)
        return True

    def items(self, conversation_id: str) -> list[str] | None:
        """Its items' JSON in order; None if it is not found."""
        conversation = self._use(conversation_id)
        return None if conversation is None else list(conversation.items.values())

    def item(self, conversation_id: str, item_id: str) -> tuple[str | None, str | None]:
        """(the conversation's JSON, the item's JSON), None for what is not found."""
        conversation = self._use(conversation_id)
        if conversation is None:
            return None, None
        return conversation.data, conversation.items.get(item_id)

    def delete_item(self, conversation_id: str, item_id: str) -> tuple[str | None, bool]:
        """(the conversation's JSON or None if it is not found, whether the item was)."""
        conversation = self._use(conversation_id)
        if conversation is None:
            return None, False
        item = conversation.items.pop(item_id, None)
        if item is not None:
            self.num_bytes -= ITEM_BYTES + len(item_id) + len(item)
        return conversation.data, item is not None

    def _use(self, conversation_id: str) -> Conversation | None:
        conversation = self.conversations.get(conversation_id)
        if conversation is not None:
            self.conversations.move_to_end(conversation_id)
        return conversation

    def _grew(self, conversation_id: str, num_bytes: int) -> None:
        """Account for num_bytes more, evicting the least recently used others past the
        budget."""
        self.num_bytes += num_bytes
        for other in list(self.conversations):
            if self.num_bytes <= self.max_bytes:
                break
            if other != conversation_id:
                self.num_bytes -= self.conversations.pop(other).num_bytes
