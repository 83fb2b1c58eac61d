"""Background batches: requests submitted together, scheduled one by one, collected here.

The scheduler actor keeps each batch's results (token ids, compactly; the ingress turns them
into text) so that any ingress replica can report its status or stream its results, and
they survive the HTTP request that submitted it. Finished batches are kept for RETENTION_S,
and at most MAX_BATCHES of them.
"""
from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import dataclass, field

RETENTION_S = 3600.0
MAX_BATCHES = 1000


@dataclass(slots=True)
class BatchState:
    batch_id: str
    num_requests: int
    stops: list[list[str]] = field(default_factory=list)  # per request, applied on reading
    created: float = field(default_factory=time.time)
    results: dict[int, dict] = field(default_factory=dict)  # index -> finished output
    tokens: dict[int, array] = field(default_factory=dict)  # index -> token ids so far
    cancelled: bool = False
    finished_at: float | None = None
    # replaced by a fresh event, and set, on every change: a reader that took the old one
    # before looking at the results can never miss a change
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @staticmethod
    def client_id(batch_id: str) -> str:
        return f"batch:{batch_id}"

    def request_id(self, index: int) -> str:
        return f"{self.batch_id}-{index}"

    def add_output(self, index: int, token_ids: list[int], finish_reason: str | None,
                   num_prompt_tokens: int, error: str | None = None) -> None:
        self.tokens.setdefault(index, array("i")).extend(token_ids)
        if finish_reason is not None:
            self.results[index] = {"index": index, "token_ids": self.tokens.pop(index),
                                   "finish_reason": finish_reason, "error": error,
                                   "num_prompt_tokens": num_prompt_tokens,
                                   "stop": self.stops[index] if self.stops else []}
            if len(self.results) == self.num_requests:
                self.finished_at = time.time()
            old, self.changed = self.changed, asyncio.Event()
            old.set()

    def result(self, index: int) -> dict:
        """A finished result with plain lists, ready to send."""
        r = self.results[index]
        return {**r, "token_ids": r["token_ids"].tolist()}

    def status(self) -> dict:
        aborted = sum(1 for r in self.results.values() if r["finish_reason"] == "abort")
        failed = sum(1 for r in self.results.values()
                     if r["error"] and r["finish_reason"] != "abort")
        done = len(self.results) == self.num_requests
        if self.cancelled:
            state = "cancelled"
        elif not done:
            state = "in_progress"
        else:
            state = "failed" if failed == self.num_requests else "completed"
        return {"id": self.batch_id, "object": "orca.batch", "status": state,
                "num_requests": self.num_requests,
                "num_completed": len(self.results) - failed - aborted,
                "num_failed": failed, "num_cancelled": aborted, "created": int(self.created)}


def prune(batches: dict[str, BatchState], now: float) -> None:
    """Drop finished batches older than RETENTION_S, then the oldest beyond MAX_BATCHES."""
    for batch_id in [b for b, s in batches.items()
                     if s.finished_at is not None and now - s.finished_at > RETENTION_S]:
        del batches[batch_id]
    finished = sorted((s.finished_at, b) for b, s in batches.items() if s.finished_at)
    for _, batch_id in finished[:max(0, len(batches) - MAX_BATCHES)]:
        del batches[batch_id]
