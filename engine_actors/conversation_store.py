"""Conversations of OpenAI's Conversations API, kept in the scheduler actor's memory beside
the stored responses (response_store.py), so that every ingress replica sees the same ones.

A conversation is its object's JSON (id, created_at, metadata) and its items' JSON in
order, each a string: their sizes are exact. The store is bounded in bytes (the server's
response_store_mib, a budget of its own): past it the least recently used conversations
go whole, never the one being written. A conversation or item evicted or deleted is not
found.

A response that continues a conversation holds it from its start (`begin`, which reads the
items) to its end (`end`, which adds its items): another one meanwhile is refused, as
OpenAI's API refuses it (its items would follow a history it never saw). The replica running
the response renews its hold while it runs (`renew`); a hold left by a replica that died
lapses LOCK_S after its last renewal.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

LOCK_S = 600.0  # how long a response's hold on its conversation lasts unless renewed
CONVERSATION_BYTES = 400  # beside its strings: the record, its dicts (measured roughly)
ITEM_BYTES = 260  # per item beside its string: its id, its entries in two dicts


@dataclass(slots=True)
class Conversation:
    data: str  # the conversation object's JSON
    items: OrderedDict[str, str] = field(default_factory=OrderedDict)  # id -> item JSON
    holder: tuple[str, float] | None = None  # (a running response's token, until when)

    @property
    def num_bytes(self) -> int:
        return CONVERSATION_BYTES + len(self.data) + sum(
            ITEM_BYTES + len(item_id) + len(item) for item_id, item in self.items.items())


class ConversationStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.conversations: OrderedDict[str, Conversation] = OrderedDict()  # oldest use first
        self.item_owner: dict[str, str] = {}  # item id -> the conversation that holds it
        self.num_bytes = 0

    def create(self, conversation_id: str, data: str, items: list[tuple[str, str]]) -> bool:
        """A new conversation with its first items ((id, JSON) each); False if it alone is
        over the budget."""
        conversation = Conversation(data, OrderedDict(items))
        if conversation.num_bytes > self.max_bytes:
            return False
        self.conversations[conversation_id] = conversation
        self.item_owner.update(dict.fromkeys(conversation.items, conversation_id))
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
            for item_id in conversation.items:
                self.item_owner.pop(item_id, None)
        return conversation is not None

    def find(self, item_ids: list[str]) -> dict[str, str]:
        """The JSON of those of the items (of any conversation) that are stored."""
        found = {}
        for item_id in item_ids:
            conversation = self._use(self.item_owner.get(item_id, ""))
            if conversation is not None and item_id in conversation.items:
                found[item_id] = conversation.items[item_id]
        return found

    def add(self, conversation_id: str, items: list[tuple[str, str]]) -> bool | None:
        """Items appended to the conversation; None if it is not found, False if it would be
        over the budget by itself (nothing is added then)."""
        conversation = self._use(conversation_id)
        if conversation is None:
            return None
        before = conversation.num_bytes
        grown = Conversation(conversation.data, OrderedDict([*conversation.items.items(),
                                                             *items]), conversation.holder)
        if grown.num_bytes > self.max_bytes:
            return False
        self.conversations[conversation_id] = grown
        self.item_owner.update((item_id, conversation_id) for item_id, _ in items)
        self._grew(conversation_id, grown.num_bytes - before)
        return True

    def begin(self, conversation_id: str, token: str, now: float) -> list[str] | bool | None:
        """A response `token` starts on the conversation: its items' JSON in order, held
        until `end`; None if it is not found, False if another response holds it."""
        conversation = self._use(conversation_id)
        if conversation is None:
            return None
        if conversation.holder is not None and conversation.holder[1] > now:
            return False
        conversation.holder = (token, now + LOCK_S)
        return list(conversation.items.values())

    def renew(self, conversation_id: str, token: str, now: float) -> bool:
        """Response `token`, still running, keeps its hold LOCK_S from now; False if it
        holds the conversation no more (ended, lapsed, or the conversation is gone)."""
        conversation = self.conversations.get(conversation_id)
        if conversation is None or conversation.holder is None or \
                conversation.holder[0] != token:
            return False
        conversation.holder = (token, now + LOCK_S)
        return True

    def end(self, conversation_id: str, token: str, items: list[tuple[str, str]]
            ) -> bool | None:
        """Response `token` ends: its items (none if it failed) added, its hold released.
        As `add`."""
        conversation = self.conversations.get(conversation_id)
        if conversation is not None and conversation.holder is not None and \
                conversation.holder[0] == token:
            conversation.holder = None
        return self.add(conversation_id, items) if items or conversation is None else True

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
            self.item_owner.pop(item_id, None)
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
                self.delete(other)
