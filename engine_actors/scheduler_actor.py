"""The singleton scheduler actor: the engine's one address for its callers.

It composes the iteration loop with worker recovery (`engine_loop`), the callers' outboxes
(`outbox`), background batches, stored responses, LoRA adapters and fine-tuning jobs; here
are start-up, teardown and the calls. An ingress replica submits with `add_requests` and
holds one `stream` call that yields, once per iteration, the updates of all its requests.

Lifetime: a named, detached actor per distinct configuration, created when the application
is built (engine_client.py's `start_engine_early`) or by a replica that finds none; it
starts its engine at once. It tears itself down, workers and placement group included: when
its last client unregisters during the application's deletion; when the last client leaves
otherwise (a scale-down, a redeploy), its last stream breaks or none ever opens, and none
comes back within ORPHAN_GRACE_S; or when the engine fails beyond recovery.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time

import ray

from engine_actors.batches import Batches
from engine_actors.checkpoint import ModelInfo, load_tokenizer, resolve_model_path
from engine_actors.config import EngineConfig
from engine_actors.engine_loop import EngineLoop, show_info_logs
from engine_actors.executor import PhaseClock, start_failure_cause
from engine_actors.finetune_jobs import FineTuning
from engine_actors.lora import Adapters
from engine_actors.messages import BatchRequest, EngineRequest, Refusal, RequestOutput
from engine_actors.metrics import EngineMetrics
from engine_actors.outbox import EarlyAborts, Outbox
from engine_actors.prefix_log import PrefixLog
from engine_actors.request import FinishReason
from engine_actors.conversation_store import ConversationStore
from engine_actors.response_store import ResponseStore

logger = logging.getLogger("orca_serve.scheduler")
NAMESPACE = "orca-serve"
ORPHAN_GRACE_S = 30.0
HEARTBEAT_S = 2.0


def actor_name(cfg: EngineConfig, rank: int = 0) -> str:
    """The scheduler actor of engine `rank` (of data_parallel_size) of this configuration."""
    return f"orca-scheduler-{cfg.fingerprint()}" + (f"-dp{rank}" if rank else "")


class SchedulerActor:
    def __init__(self, cfg: EngineConfig, created_at: float | None = None, rank: int = 0):
        """`created_at`: time.time() when the creator asked for this actor (its process's
        start and imports count in the start's phases; another node's clock: 0 if behind).
        `rank`: which of the data_parallel_size engines this is (the first keeps the stores
        and batches)."""
        show_info_logs()
        self._clock = PhaseClock({"scheduler process": max(0.0, time.time() - created_at)}
                                 if created_at is not None else None)
        self.cfg, self.rank = cfg, rank
        self.engine: EngineLoop | None = None
        self.metrics = EngineMetrics(cfg.model_name, rank)
        self._http_metrics: dict[str, tuple[int, list]] = {}  # replica -> (seq, snapshot)
        self.adapters = Adapters(cfg, self.metrics.lora_request)  # LoRA adapters
        self.finetuning = FineTuning(cfg, self.adapters, self.metrics) \
            if cfg.enable_finetuning else None
        self.outboxes: dict[str, Outbox] = {}
        self.responses = ResponseStore(cfg.response_store_mib * 2**20, self._cancel)
        self.conversations = ConversationStore(cfg.response_store_mib * 2**20)
        self.prefixes = PrefixLog()  # the replicas' routes (data parallelism, first engine)
        self.batches = Batches(self._add, self.abort,
                               lambda: load_tokenizer(resolve_model_path(cfg.model)))
        self.draining = False
        self._started: asyncio.Task | None = None
        self._start_error: str | None = None
        self._tasks: set[asyncio.Task] = set()  # background tasks, kept alive
        self._early_aborts = EarlyAborts()
        self._orphan_check = 0  # number of the newest orphan check: only that one may act
        with contextlib.suppress(RuntimeError):  # as a Ray actor: its event loop runs
            asyncio.get_running_loop()
            self._start_once()

    # ---- life cycle -------------------------------------------------------------------
    def _start_once(self) -> None:
        """Start the engine (the actor's creator need not wait for it or even stay alive),
        and the check that a client comes to use it."""
        if self._started is None:
            self._started = self._spawn(self._start())
            self._check_orphaned()  # nobody may ever connect

    async def ready(self) -> ModelInfo:
        """Returns the model info once the workers are ready (started if they are not)."""
        self._start_once()
        await asyncio.shield(self._started)
        if self._start_error is not None:
            raise RuntimeError(self._start_error)
        return self.engine.info

    async def _start(self) -> None:
        try:
            self.adapters.load_configured()
            self.engine = await EngineLoop.start(
                self.cfg, f"{actor_name(self.cfg, self.rank)}-workers", self.metrics,
                self._deliver, self._clock)
            await self.adapters.know_engine(self.engine)
            self.engine.finetuning = self.finetuning
            gc.collect()  # then the startup heap: full collections under load skip it
            gc.freeze()
            self._spawn(self._run())
        except Exception as e:
            if self.engine is not None:  # a configured adapter does not fit the model
                self.engine.shutdown()
                self.engine = None
            self._start_error = start_failure_cause(e)
            logger.error("engine failed to start: %s", self._start_error)
            logger.debug("start failure", exc_info=True)
            # every caller gets the error at once until the orphan teardown (no client ever
            # registers): a retry by a new replica starts from scratch, ORPHAN_GRACE_S later

    async def _run(self) -> None:
        try:
            await self.engine.run()
        except Exception:
            await self._teardown()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        """Fail what is left, stop the workers, free their devices, and exit."""
        if self.engine is not None:
            self._deliver(self.engine.scheduler.fail_all(), "the engine was shut down")
        await self._teardown()

    async def unregister(self, client_id: str, final: bool = True) -> None:
        """An ingress replica is shutting down. The last one takes the engine with it when
        the application is being deleted (final); otherwise (a scale-down, or a redeploy
        whose new replicas have not connected yet) the engine waits ORPHAN_GRACE_S for one."""
        self._drop_client(client_id)
        if not self.outboxes:
            if final:
                await self._teardown()
            else:
                self._check_orphaned()

    def _check_orphaned(self) -> None:
        """No client (a replica died, or none connected): wait ORPHAN_GRACE_S for one, else
        go. Only the newest check acts: an older one, started at an earlier departure, must
        not end the engine inside a later redeploy's gap."""
        self._orphan_check += 1
        self._spawn(self._teardown_if_unused(self._orphan_check))

    async def _teardown_if_unused(self, check: int) -> None:
        if self._started is not None:  # the time the engine takes to start does not count
            await asyncio.shield(self._started)
        await asyncio.sleep(ORPHAN_GRACE_S)
        if check == self._orphan_check and not self.outboxes:
            await self._teardown()

    async def _teardown(self) -> None:
        logger.info("shutting the engine down")
        if self.engine is not None:
            self.engine.shutdown()
        if self.finetuning is not None:
            self.finetuning.close()
        # exit_actor() would wait for the open stream calls; nothing here needs a goodbye
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    # ---- requests ---------------------------------------------------------------------
    async def add_requests(self, client_id: str,
                           requests: list[EngineRequest]) -> list[Refusal | None]:
        """Queue a caller's requests (one iteration may take them all; an adapter they name
        loads first, with dynamic_lora_loading_path); per request, None or why refused."""
        await self.ready()
        outbox = self.outboxes.get(client_id) or self.outboxes.setdefault(client_id,
                                                                          Outbox(client_id))
        loaded = await self.adapters.resolve_all(r.lora_name for r in requests)
        return [loaded[r.lora_name] or self._add(outbox, r) for r in requests]

    def _add(self, sink, r: EngineRequest) -> Refusal | None:
        if self._early_aborts.take(r.request_id):
            return None  # aborted before it was added
        if self.draining and not r.continues:
            return Refusal("draining", "the server is shutting down")
        refusal = None if r.continues else self.engine.queue_full()
        if refusal is not None:
            return refusal
        adapter = self.adapters.of(r.lora_name)  # counted per adapter
        if isinstance(adapter, Refusal):
            return adapter
        refusal = self.engine.add(r, sink, adapter)
        if refusal is None and isinstance(sink, Outbox):
            sink.add(r.request_id, r.search)
        return refusal

    def abort(self, request_ids: list[str], stopped: bool = False, cancelled=False) -> None:
        """End requests; `stopped`: by a stop string; `cancelled`: by a background response's
        cancel, from any replica (their own caller is told)."""
        reason = FinishReason.STOP if stopped else FinishReason.ABORT
        for rid in request_ids:
            out = self.engine.scheduler.abort(rid, reason) if self.engine else None
            if out is None:
                self._early_aborts.remember(rid)
                continue
            self.metrics.finished(out.finish_reason, out.num_prompt_tokens, out.num_output_tokens)
            out.sink.deliver(out, None) if cancelled else out.sink.aborted(out)

    def _cancel(self, request_ids: list[str], cancelled: bool = True) -> None:
        """A background response's cancel (the response store's): with data parallelism its
        requests may run on any engine, and each ends those it has."""
        self.abort(request_ids, cancelled=cancelled)
        for rank in range(1, self.cfg.data_parallel_size):
            with contextlib.suppress(ValueError):  # that engine is gone, with its requests
                peer = ray.get_actor(actor_name(self.cfg, rank), namespace=NAMESPACE)
                peer.abort.remote(request_ids, cancelled=cancelled)

    def end_search(self, client_id: str, search: str) -> None:  # a drain waits no more
        self.outboxes.get(client_id, Outbox(client_id)).end_search(search)

    def _deliver(self, outputs: list[RequestOutput], error: str | None) -> None:
        self.metrics.count(outputs)
        for out in outputs:
            out.sink.deliver(out, error)

    async def stream(self, client_id: str, owner=None):
        """Yields this caller's outputs since the last yield (see Outbox). `owner`: its actor
        handle, watched (Ray does not end this call when the caller dies)."""
        outbox = self.outboxes.setdefault(client_id, Outbox(client_id))
        self._orphan_check += 1  # a client connected: the pending orphan checks stand down
        try:
            async for batch in outbox.stream(owner, HEARTBEAT_S):
                yield batch
        finally:
            # the replica is gone (or cancelled its stream): nobody can receive these tokens
            self._drop_client(client_id)
            if not self.outboxes:
                self._check_orphaned()

    def _drop_client(self, client_id: str) -> None:
        self.abort(list(self.outboxes.pop(client_id, Outbox(client_id)).request_ids))
        self.responses.owner_gone(client_id)

    async def adapter_call(self, method: str, *args):  # lora.Adapters' methods
        await self.ready()
        result = getattr(self.adapters, method)(*args)
        return await result if asyncio.iscoroutine(result) else result

    async def finetune_call(self, method: str, *args):  # FineTuning's files and jobs
        await self.ready()
        if method == "create":
            self.engine.wake()  # an idle loop starts training at once
        if method == "cancel":
            return await self.finetuning.cancel(*args, self.engine.executor)
        return getattr(self.finetuning, method)(*args)

    async def response_call(self, method: str, *args):  # ResponseStore's put, get, ...
        result = getattr(self.responses, method)(*args)  # (events_after waits for some)
        return await result if asyncio.iscoroutine(result) else result

    def conversation_call(self, method: str, *args):  # ConversationStore's create, get, ...
        return getattr(self.conversations, method)(*args)

    def share_prefixes(self, replica: str, entries: list, log: str | None, since: int):
        return self.prefixes.share(replica, entries, log, since)  # (PrefixLog's)

    async def submit_batch(self, batch_id: str, requests: list[BatchRequest],
                           priority: int = 1, first_index: int = 0,
                           total: int | None = None) -> Refusal | None:
        """A batch, or this engine's share of it (its requests from first_index on, of
        `total`)."""
        await self.ready()  # (adapters named load first, as in add_requests)
        loaded = await self.adapters.resolve_all(r.lora_name for r in requests)
        return next(filter(None, loaded.values()), None) or await self.batches.submit(
            batch_id, requests, priority, self.cfg.max_queued_requests, first_index, total)

    def batch_call(self, method: str, batch_id: str) -> dict | None:  # status, cancel; None: none
        return getattr(self.batches, method)(batch_id)

    async def batch_results(self, batch_id: str):
        async for results in self.batches.results(batch_id):
            yield results

    # ---- operations -------------------------------------------------------------------
    def stats(self) -> dict:
        state = "draining" if self.draining else "starting" if self.engine is None else \
            "recovering" if self.engine.is_recovering else "ready"
        return {"state": state, "num_clients": len(self.outboxes),
                **(self.engine.stats() if self.engine else {}), **self.adapters.stats(),
                **self.responses.stats(), **(self.finetuning.stats() if self.finetuning else {})}

    async def health(self) -> dict:  # stats(), and whether every worker answers
        alive = bool(self.engine) and await self.engine.executor.all_alive()
        health = {**self.stats(), "workers_alive": alive}
        if self.finetuning and alive:  # the trainers' device memory, as the worker counts it
            health["finetuning"]["worker_state_bytes"] = \
                await self.engine.executor.finetune("resident", "")
        return health

    def metrics_text(self) -> bytes:
        if self.engine is not None:
            self.engine.update_gauges()
        return self.metrics.render()

    def http_metrics(self, replica: str, seq: int, snapshot: list) -> dict[str, list]:
        """Keep a replica's request metrics (deployments/http_metrics.py), numbered by seq (a
        late older one is dropped), also after it stops (totals never go back); all latest."""
        if seq > self._http_metrics.get(replica, (-1, None))[0]:
            self._http_metrics[replica] = (seq, snapshot)
        return {r: s for r, (_, s) in self._http_metrics.items()}

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; end those running (or searching) after timeout_s ("abort")."""
        self.draining = True
        if self.engine is not None:
            self._deliver(await self.engine.drain(timeout_s, lambda: any(
                o.searches for o in self.outboxes.values())), None)

    async def executor_call(self, method: str, *args):
        """Operations and diagnosis on the workers (Executor's: `workers`, stage-major;
        `inject_fault(i)`, worker i raises in its next step; `step_traces`, `gpu_timeline`)."""
        await self.ready()
        result = getattr(self.engine.executor, method)
        return await result(*args) if callable(result) else result
