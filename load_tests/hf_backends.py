"""The two transformers baselines as online backends of load_tests/hf_server.py: requests
arrive one by one over HTTP instead of as a whole trace at t=0 (hf_baselines.py, whose
helpers both reuse, so the online and offline baselines generate the same way).

A backend takes a GenRequest and puts Updates (new token ids, then a finish reason, or an
error) on the request's asyncio queue; the HTTP layer turns them into text and SSE.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from load_tests.hf_baselines import (NO_EOS, _cb_config, _check_cb_api, _generate_batch,
                                     _pad_id)
from load_tests.traces import TraceRequest


@dataclass(slots=True)
class Update:
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last update: "length" or "stop"
    error: str | None = None


@dataclass(slots=True, eq=False)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0  # tokens the HTTP side has consumed
    num_queued_tokens: int = 0  # tokens the backend has queued
    is_finished: bool = False  # the last Update has been queued
    is_cancelled: bool = False


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def submit(self, req: GenRequest) -> None: ...
    def cancel(self, req: GenRequest) -> None: ...


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}


def _finish(req: GenRequest, update: Update) -> None:
    req.is_finished = True
    req.updates.put_nowait(update)


class StaticBackend:
    """Request-level scheduling: FCFS batches of up to `max_batch_size` queued requests, each
    batch generated to its longest request before the next one starts."""
    name = "static"

    def __init__(self, model, max_batch_size: int = 32):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.model, self.max_batch_size = model, max_batch_size
        self.pad_id, self.eos_ids = _pad_id(model), _eos_ids(model)
        self._queue: asyncio.Queue[GenRequest] | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, req: GenRequest) -> None:
        self._queue.put_nowait(req)

    def cancel(self, req: GenRequest) -> None:
        # A batch, once started, runs to its end (that is the baseline); a queued request
        # is skipped when its batch is formed.
        req.is_cancelled = True

    async def _loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [r for r in batch if not r.is_cancelled]
            if not batch:
                continue
            trace = [TraceRequest(r.prompt_ids, r.max_tokens) for r in batch]
            try:
                outputs = await asyncio.to_thread(_generate_batch, self.model, trace, self.pad_id)
            except Exception as e:  # the batch's requests fail; the server goes on
                for r in batch:
                    _finish(r, Update([], error=f"generate failed: {type(e).__name__}: {e}"))
                continue
            for r, ids in zip(batch, outputs):
                reason = "length"
                if not r.ignore_eos:
                    cut = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
                    if cut is not None:
                        ids, reason = ids[:cut], "stop"
                _finish(r, Update(ids, reason))


class ContinuousBackend:
    """transformers' continuous batching manager, streaming each request token by token.

    One thread drains the manager's shared output queue (`get_result`) and hands every
    output to the event loop; per-request waiting (`request_id_iter`) would re-queue other
    requests' outputs and poll, which does not scale to hundreds of concurrent requests.
    """
    name = "cb"

    def __init__(self, model, cb_config: dict | None = None):
        _check_cb_api(model)
        self.model = model
        self.cb_config = _cb_config(cb_config)  # unknown keys fail here, before serving
        self.eos_ids = sorted(_eos_ids(model))
        self._pending: dict[str, GenRequest] = {}
        self._mgr = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        from transformers import GenerationConfig

        self._loop = asyncio.get_running_loop()
        gen_config = GenerationConfig(do_sample=False, eos_token_id=NO_EOS,
                                      pad_token_id=_pad_id(self.model))
        self._mgr = self.model.init_continuous_batching(
            generation_config=gen_config, continuous_batching_config=self.cb_config)
        await asyncio.to_thread(self._mgr.warmup)
        self._mgr.start()
        self._thread = threading.Thread(target=self._drain, name="cb-results", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._mgr is not None:
            await asyncio.to_thread(self._mgr.stop, block=True)
            self._mgr.destroy()

    async def submit(self, req: GenRequest) -> None:
        self._pending[req.request_id] = req
        eos = NO_EOS if req.ignore_eos or not self.eos_ids else self.eos_ids
        # add_request may block briefly when the manager's input queue is full
        rid = await asyncio.to_thread(self._mgr.add_request, req.prompt_ids,
                                      request_id=req.request_id, max_new_tokens=req.max_tokens,
                                      streaming=True, eos_token_id=eos)
        if rid is None:
            self._pending.pop(req.request_id, None)
            _finish(req, Update([], error="continuous batching refused the request "
                                          "(manager stopped or failed)"))

    def cancel(self, req: GenRequest) -> None:
        req.is_cancelled = True
        if self._pending.pop(req.request_id, None) is not None:
            self._mgr.cancel_request(req.request_id)

    def _drain(self) -> None:
        while not self._stopping.is_set():
            output = self._mgr.get_result(timeout=0.1)
            if output is not None:
                self._loop.call_soon_threadsafe(self._deliver, output)
            elif not self._mgr.is_running():
                self._loop.call_soon_threadsafe(self._fail_all, "continuous batching stopped")
                return

    def _deliver(self, output) -> None:
        req = self._pending.get(output.request_id)
        if req is None:  # cancelled, or a warm-up request of the manager
            return
        if output.error is not None:
            self._pending.pop(req.request_id)
            _finish(req, Update([], error=f"continuous batching: {output.error}"))
            return
        tokens = output.generated_tokens  # cumulative in streaming mode
        new = list(tokens[req.num_queued_tokens:])
        req.num_queued_tokens = len(tokens)
        if output.is_finished():
            self._pending.pop(req.request_id)
            _finish(req, Update(new, "length" if len(tokens) >= req.max_tokens else "stop"))
        elif new:
            req.updates.put_nowait(Update(new))

    def _fail_all(self, message: str) -> None:
        for req in self._pending.values():
            _finish(req, Update([], error=message))
        self._pending.clear()
