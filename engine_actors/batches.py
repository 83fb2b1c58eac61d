"""Background batches: requests submitted together, scheduled one by one, collected here.

The scheduler actor keeps each batch's results (token ids, compactly; the ingress turns them
into text) so that any ingress replica can report its status or stream its results, and
they survive the HTTP request that submitted it. A request with stop strings is decoded as
it runs and aborted at the first match, as a streamed request is. Finished batches are kept
for RETENTION_S, and at most MAX_BATCHES of them.
"""
from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable

from engine_actors.detokenizer import TextStream
from engine_actors.messages import (BatchRequest, BatchResult, EngineRequest, Refusal,
                                    RequestOutput)

RETENTION_S = 3600.0
MAX_BATCHES = 1000
CANCELLED = "cancelled"


class BatchState:
    """One batch; the sink of its requests (see engine_actors.outbox.Sink)."""

    def __init__(self, batch_id: str, num_requests: int, stop_request: Callable[[str], None],
                 text_streams: dict[int, TextStream] | None = None, first_index: int = 0,
                 total: int | None = None):
        """`first_index`: of its first request in the whole batch of `total` (with data
        parallelism, each engine runs a share of it: requests first_index, first_index + 1,
        ...; None: the whole batch is here)."""
        self.batch_id = batch_id
        self.num_requests = num_requests
        self.indices = range(first_index, first_index + num_requests)
        self.total = total
        self.created = time.time()
        self.results: dict[int, BatchResult] = {}
        self.tokens: dict[int, array] = {}  # index -> token ids so far
        self.text_streams = text_streams or {}  # index -> decoder, for requests with stops
        self.cancelled = False
        self.finished_at: float | None = None
        self._stop_request = stop_request  # abort a request whose stop string matched
        # replaced by a fresh event, and set, on every change: a reader that took the old one
        # before looking at the results can never miss a change
        self.changed = asyncio.Event()

    def request_id(self, index: int) -> str:
        return f"{self.batch_id}-{index}"

    def deliver(self, out: RequestOutput, error: str | None) -> None:
        index = int(out.request_id.rpartition("-")[2])
        if index in self.results:
            return  # ended at a stop string; the rest was in flight
        tokens = self.tokens.setdefault(index, array("i"))
        tokens.extend(out.new_token_ids)
        reason = out.finish_reason
        stream = self.text_streams.get(index)
        if stream is not None:
            stream.add(out.new_token_ids, is_final=reason is not None)
            if stream.is_stopped:
                del tokens[stream.num_tokens_used:]  # what came after the stop string
                self._finish(index, "stop", out, None)
                if reason is None:  # still running: end it now
                    self._stop_request(out.request_id)
                return
        if reason is not None:
            self._finish(index, reason, out, error)

    def aborted(self, out: RequestOutput) -> None:
        index = int(out.request_id.rpartition("-")[2])
        if index not in self.results:
            self.tokens.setdefault(index, array("i"))
            self._finish(index, "abort", out, CANCELLED)

    def _finish(self, index: int, reason: str, out: RequestOutput, error: str | None):
        stream = self.text_streams.pop(index, None)
        self.results[index] = BatchResult(index, self.tokens.pop(index).tolist(), reason,
                                          out.num_prompt_tokens, error,
                                          stream.stop if stream is not None else [],
                                          out.num_cached_tokens)
        if len(self.results) == self.num_requests:
            self.finished_at = time.time()
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def status(self) -> dict:
        aborted = sum(1 for r in self.results.values() if r.finish_reason == "abort")
        failed = sum(1 for r in self.results.values()
                     if r.error and r.finish_reason != "abort")
        done = len(self.results) == self.num_requests
        if self.cancelled:
            state = "cancelled"
        elif not done:
            state = "in_progress"
        else:
            state = "failed" if failed == self.num_requests else "completed"
        share = {} if self.total is None else {"total": self.total}  # (merged away)
        return {"id": self.batch_id, "object": "orca.batch", "status": state,
                "num_requests": self.num_requests,
                "num_completed": len(self.results) - failed - aborted,
                "num_failed": failed, "num_cancelled": aborted, "created": int(self.created),
                **share}


class Batches:
    """The batches of one engine. `add(sink, request)` queues a request (or refuses it);
    `abort(request_ids, stopped)` ends requests (stopped: at a stop string);
    `tokenizer()` loads the model's tokenizer."""

    def __init__(self, add: Callable[[object, EngineRequest], Refusal | None],
                 abort: Callable[[list[str], bool], None], tokenizer: Callable[[], object]):
        self._add, self._abort, self._tokenizer = add, abort, tokenizer
        self.batches: dict[str, BatchState] = {}

    async def submit(self, batch_id: str, requests: list[BatchRequest], priority: int,
                     max_queued: int, first_index: int = 0,
                     total: int | None = None) -> Refusal | None:
        """Queue every request of a batch (or of its share from first_index on, of
        `total`), or none: the first refusal ("request i: ...")."""
        self.prune(time.time())
        if len(requests) > max_queued:
            return Refusal("batch_too_large", f"a batch of {len(requests)} requests can never "
                           f"fit the queue of {max_queued}; split it")
        streams = {}
        if any(r.stop for r in requests):
            tokenizer = await asyncio.to_thread(self._tokenizer)
            streams = {i: TextStream(tokenizer, r.stop)
                       for i, r in enumerate(requests, first_index) if r.stop}
        state = BatchState(batch_id, len(requests), lambda rid: self._abort([rid], True), streams,
                           first_index, total)
        self.batches[batch_id] = state
        for i, r in enumerate(requests, first_index):
            refusal = self._add(state, EngineRequest(state.request_id(i), r.prompt_token_ids,
                                                     r.sampling, priority, r.deadline_ms,
                                                     r.lora_name))
            if refusal is not None:
                self._abort([state.request_id(j) for j in range(first_index, i)], False)
                del self.batches[batch_id]
                return Refusal(refusal.code, f"request {i}: {refusal.message}")
        return None

    def status(self, batch_id: str) -> dict | None:
        self.prune(time.time())
        state = self.batches.get(batch_id)
        return state.status() if state else None

    def cancel(self, batch_id: str) -> dict | None:
        state = self.batches.get(batch_id)
        if state is None:
            return None
        if len(state.results) < state.num_requests:  # a finished batch stays as it ended
            state.cancelled = True
        self._abort([state.request_id(i) for i in state.indices if i not in state.results],
                    False)
        return state.status()

    async def results(self, batch_id: str):
        """Yields lists of finished results, the ones already finished first, until every
        request of the batch has finished."""
        state = self.batches.get(batch_id)
        if state is None:
            return
        sent: set[int] = set()
        while True:
            changed = state.changed
            new = [r for i, r in state.results.items() if i not in sent]
            sent.update(r.index for r in new)
            if new:
                yield new
            if len(sent) == state.num_requests:
                return
            await changed.wait()

    def prune(self, now: float) -> None:
        """Drop finished batches older than RETENTION_S, then the oldest beyond MAX_BATCHES."""
        batches = self.batches
        for batch_id in [b for b, s in batches.items()
                         if s.finished_at is not None and now - s.finished_at > RETENTION_S]:
            del batches[batch_id]
        finished = sorted((s.finished_at, b) for b, s in batches.items() if s.finished_at)
        for _, batch_id in finished[:max(0, len(batches) - MAX_BATCHES)]:
            del batches[batch_id]
