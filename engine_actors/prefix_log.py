"""The prompt prefixes the ingress replicas sent to each data-parallel engine, shared among
the replicas (deployments/engines.py): each hands over what it routed since its last call
and takes what the others routed, so a conversation's next turn finds its engine whichever
replica receives it. Kept by the first engine's scheduler actor; the oldest are dropped."""
from __future__ import annotations

import collections
import uuid

MAX_ENTRIES = 1 << 17


class PrefixLog:
    def __init__(self, capacity: int = MAX_ENTRIES):
        # (seq, replica, prefix hash, engine rank), seq numbered from 1
        self.entries: collections.deque = collections.deque(maxlen=capacity)
        self.seq = 0
        self.id = uuid.uuid4().hex  # (a new actor's log numbers from 1 again)

    def share(self, replica: str, entries: list[tuple[int, int]], log: str | None,
              since: int) -> tuple[str, int, list[tuple[int, int]]]:
        """Add `replica`'s (prefix hash, engine) entries; the others' added after number
        `since` of log `log` (this log's id and last number are returned), oldest first."""
        if log != self.id:  # numbered by another log (this actor is new): all of them
            since = 0
        news = []
        for seq, r, h, rank in reversed(self.entries):
            if seq <= since:
                break
            if r != replica:
                news.append((h, rank))
        news.reverse()
        for h, rank in entries:
            self.seq += 1
            self.entries.append((self.seq, replica, h, rank))
        return self.id, self.seq, news
