"""Fine-tuning jobs in the GPU's idle time: FineInfer's deferred continuous batching.

The scheduler actor keeps the uploaded training files and the jobs (OpenAI's shapes), one
job training at a time, the others queued. FineInfer's rule (§2.4): while a job could
step, a new request joins the running batch only once its time in the queue plus the
estimated time of one fine-tuning step is over `finetune_deferral_ms` (`hold_from`);
until then it is deferred, so the batch drains (only while the batch can drain in time:
an addition to FineInfer, which holds requests even when no step could run within their
bound). Between inference iterations the engine
loop asks `wants_step`: a fine-tuning micro-batch runs when no request is running and
every waiting request can still be deferred; otherwise inference runs. A step longer than
the bound never runs whole (another addition: whoever arrived during it would wait past the
bound); its micro-batches run in pieces (finetune_busy.py). Step times are measured (an
exponential average, whole or as the pieces' sum). The micro-batch runs on the
worker (`engine_actors/finetune.py`, sent by finetune_steps.py); when the last step is done
the adapter is saved in PEFT's format and served at once under the job's `fine_tuned_model`.

Memory: a micro-batch needs device memory for its activations, measured per token after
each step (until then a micro-batch is one example, and an estimate from the model's size
stands in). When the memory free beside the KV pool is short, the KV manager lends the
workers free blocks at the end of the pool, whose memory they release for the step
(kv_memory.py): cached prefix blocks there are evicted; blocks of running requests and
reserved ones are never taken. The micro-batch shrinks to what is free, and blocks are
lent only once it is known to fit (otherwise the job waits, evicting nothing); an example
that could not fit even in the whole pool fails its job. Before inference runs again the
workers map the blocks back; if the memory is not there, the job fails and its trainer
is freed, so serving never loses its KV pool to training.
"""
from __future__ import annotations

import logging
import os
import time
import uuid

import ray

from engine_actors.finetune_busy import BusyTraining
from engine_actors.finetune_job import Job
from engine_actors.lora_files import temp_adapter_dir
from engine_actors.finetune_steps import TrainingSteps
from engine_actors.messages import Refusal, page

logger = logging.getLogger("orca_serve.finetune")
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_STORED_BYTES = 16 * MAX_FILE_BYTES  # all files kept (in the scheduler actor's memory)
MAX_QUEUED_JOBS = 64  # queued and running jobs, each holding its tokenized examples
# (an ended job frees them and keeps only its record and events)
# after a second with no request arriving, the next micro-batch is sent while one runs
# (the engine loop's `pipeline`)
QUIET_S = 1.0


def may_defer(waited_s: list[float], step_s: float | None, bound_s: float) -> bool:
    """FineInfer's rule: requests waiting `waited_s` may wait for one more fine-tuning step
    (of estimated `step_s`; None: not measured yet, so only when none waits)."""
    if not waited_s:
        return True
    return step_s is not None and max(waited_s) + step_s <= bound_s


def _page(items: list[dict], after: str | None, limit: int, what: str) -> dict | Refusal:
    """A page of `items` (messages.page); a refusal naming `what` when `after` is none of
    their ids."""
    try:
        return page(items, after, limit)
    except KeyError:
        return Refusal("unknown_after", f"after: no {what} {after!r}")


class FineTuning(TrainingSteps):
    """The scheduler actor's files and jobs, and when their steps run (the steps
    themselves: finetune_steps.py)."""

    def __init__(self, cfg, adapters, metrics=None):
        super().__init__(cfg, metrics)
        self.adapters = adapters
        # the default directory goes with the engine (close): finetune_dir keeps them
        self._temp = None if cfg.finetune_dir else temp_adapter_dir()
        self.dir = cfg.finetune_dir or self._temp.name
        self.files: dict[str, tuple[dict, bytes]] = {}
        self.jobs: dict[str, Job] = {}
        self.bound_s = cfg.finetune_deferral_ms / 1e3
        # training in pieces: beside running requests with a share, and between requests
        # when a whole micro-batch would hold them past the bound (finetune_busy.py)
        self.busy = BusyTraining(self, cfg.finetune_busy_share)

    def close(self) -> None:
        """The engine is shutting down: remove the default directory of saved adapters."""
        if self._temp is not None:
            self._temp.cleanup()

    # ---- files --------------------------------------------------------------------------
    def add_file(self, filename: str, purpose: str, content: bytes) -> dict | Refusal:
        stored = sum(meta["bytes"] for meta, _ in self.files.values())
        if stored + len(content) > MAX_STORED_BYTES:
            return Refusal("storage_full", f"the server keeps at most {MAX_STORED_BYTES} bytes "
                           f"of files and holds {stored}: delete some (DELETE /v1/files/{{id}})")
        meta = {"object": "file", "id": f"file-{uuid.uuid4().hex[:24]}", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed"}
        self.files[meta["id"]] = (meta, content)
        return meta

    def file(self, file_id: str, content: bool = False):
        entry = self.files.get(file_id)
        return None if entry is None else entry[1] if content else entry[0]

    def list_files(self, after: str | None = None, limit: int = 10_000, order: str = "desc",
                   purpose: str | None = None) -> dict | Refusal:
        files = [meta for meta, _ in self.files.values()  # in upload order
                 if purpose is None or meta["purpose"] == purpose]
        return _page(files[::-1] if order == "desc" else files, after, limit, "file")

    def delete_file(self, file_id: str) -> dict | None:
        """Forget a file (jobs made from it keep their parsed examples)."""
        if self.files.pop(file_id, None) is None:
            return None
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- jobs ---------------------------------------------------------------------------
    def create(self, spec: dict) -> dict | Refusal:
        if len(self.queue) >= MAX_QUEUED_JOBS:
            return Refusal("queue_full", f"{len(self.queue)} fine-tuning jobs are queued or "
                           "running; retry when one has ended")
        if spec["lora"]["r"] > self.cfg.max_lora_rank:
            return Refusal("invalid_value", f"lora.r {spec['lora']['r']} is over the server's "
                           f"max_lora_rank {self.cfg.max_lora_rank}")
        job = Job(id=f"ftjob-{uuid.uuid4().hex[:24]}", **spec)
        self.jobs[job.id] = job
        self.queue.append(job)
        job.event(f"Created fine-tuning job: {job.id}")
        return job.to_dict()

    def job(self, job_id: str) -> dict | None:
        job = self.jobs.get(job_id)
        return job.to_dict() if job else None

    def list_jobs(self, after: str | None = None, limit: int = 20,
                  metadata: dict | str | None = None) -> dict | Refusal:
        """Newest first, as OpenAI lists them; `metadata`: values the jobs' metadata must
        have (None: any; "null": jobs without metadata)."""
        def wanted(job: Job) -> bool:
            if metadata == "null":
                return not job.metadata
            return all((job.metadata or {}).get(k) == v for k, v in (metadata or {}).items())
        jobs = list(reversed(self.jobs.values()))
        if after is not None:  # (any job's id: it may be one the filter leaves out)
            at = next((i for i, j in enumerate(jobs) if j.id == after), None)
            if at is None:
                return Refusal("unknown_after", f"after: no fine-tuning job {after!r}")
            jobs = jobs[at + 1:]
        return _page([j.to_dict() for j in jobs if wanted(j)], None, limit, "fine-tuning job")

    def events(self, job_id: str, after: str | None = None,
               limit: int = 20) -> dict | Refusal | None:
        job = self.jobs.get(job_id)
        return None if job is None else _page(job.events[::-1], after, limit,  # newest first
                                               f"event of job {job_id}")

    async def cancel(self, job_id: str, executor) -> dict | Refusal | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job.status not in ("queued", "running"):
            return Refusal("invalid_state", f"job {job_id} is already {job.status}")
        if self.ahead is not None and self.ahead.job is job:
            self.skip_ahead(executor)  # its micro-batch sent ahead need not run
        self._end(job, "cancelled")
        job.event("Fine-tuning job cancelled")
        await self._drop(job, executor)
        return job.to_dict()

    # ---- the engine loop's side ---------------------------------------------------------
    def wants_step(self, scheduler, now: float) -> bool:
        """Whether a whole micro-batch runs now (FineInfer's rule). One longer than the
        bound never does: whoever arrived during it would wait past the bound, and no quiet
        spell says none will (arrivals are memoryless). Its micro-batches run in pieces
        instead (`in_pieces`), a request waiting for a piece at most."""
        if not self.queue or scheduler.num_running or now < self.retry_at \
                or self.busy.active or self.in_pieces:
            return False
        return may_defer([now - r.arrival_time for r in scheduler.waiting], self.step_cost_s,
                         self.bound_s)

    @property
    def in_pieces(self) -> bool:
        """A whole micro-batch would take longer than the bound (as measured whole or in
        pieces): the job's micro-batches run in pieces, also between requests."""
        cost = self.step_cost_s
        return cost is not None and cost > self.bound_s

    @property
    def step_cost_s(self) -> float | None:
        """What one more step delays inference by: the step, and mapping the lent memory
        back afterwards (both measured; None until a step is)."""
        if self.step_s is None:
            return None
        return self.step_s + (self.take_back_s or 0.0)

    def hold_from(self, now: float, drain_s: float) -> float | None:
        """FineInfer's deferral of new requests: while a job could step, a request that
        arrived at or after the returned time is not added to the running batch (its wait
        plus one step stays within the bound), so the batch drains and the step runs when
        it is empty. Only when the batch can drain in time (`drain_s`: the running
        requests' longest remaining decode, estimated), so holding never delays a request
        for a step that could not run within its bound. None: nothing is held (no job, a
        job waiting for memory, the step's time unknown, no time for it, or a micro-batch in
        pieces under way, which no whole one follows until it ends)."""
        step_s = self.step_cost_s
        if not self.queue or now < self.retry_at or step_s is None \
                or drain_s + step_s > self.bound_s or self.busy.active:
            return None
        return now - (self.bound_s - step_s - drain_s)

    def wake_in(self, now: float) -> float | None:
        """Seconds until a job waiting for memory may try again, whole or in pieces (None:
        none waits)."""
        if not self.queue:
            return None
        waits = [w for w in (self.retry_at - now, self.busy.retry_at - now) if w > 0]
        return min(waits) if waits else None

    async def _finish(self, job: Job, executor) -> None:
        name = f"ft:{self.cfg.model_name}:{job.suffix or 'orca'}:{job.id[len('ftjob-'):][:8]}"
        path = os.path.join(self.dir, job.id)
        try:
            await executor.finetune("save", job.id, path, self.cfg.model)
        except ray.exceptions.RayError as e:
            if job.status == "running":
                self._fail(job, f"saving the adapter failed: {e}".splitlines()[0])
        else:
            if job.status != "running":  # cancelled while it was saved (and dropped)
                return
            refusal = await self.adapters.load(name, path)
            if job.status != "running":  # cancelled while its files were read (and dropped)
                if refusal is None:
                    self.adapters.unload(name)
                return
            if refusal is not None:
                self._fail(job, refusal.message)
            else:
                job.fine_tuned_model = name
                self._end(job, "succeeded")
                job.event(f"The job has successfully completed: {name}")
        await self._drop(job, executor)

    def _fail(self, job: Job, message: str) -> None:
        logger.warning("fine-tuning job %s failed: %s", job.id, message)
        job.error = {"code": "training_failed", "message": message, "param": None}
        self._end(job, "failed")
        job.event(f"Fine-tuning job failed: {message}", level="error")

    def _end(self, job: Job, status: str) -> None:
        job.status, job.finished_at = status, int(time.time())
        job.release()
        if job in self.queue:
            self.queue.remove(job)

    def stats(self) -> dict:
        running = self.queue[0].id if self.queue and self.queue[0].started else None
        return {"finetuning": {"running_job": running, "queued_jobs": len(self.queue) - bool(running),
                               "step_ms_estimate": None if self.step_s is None
                               else round(self.step_s * 1e3, 1),
                               "trainer_ms": None if self.train_s is None
                               else round(self.train_s * 1e3, 1),
                               "micro_batch_tokens": round(self.micro_tokens),
                               "bytes_per_token": self.queue[0].bytes_per_token
                               if running else None,
                               "alloc_retries": (self.memory or {}).get("alloc_retries", 0),
                               "micro_batches_sent_ahead": self.num_ahead,
                               # (sent ahead whole, or in pieces holding lent blocks)
                               "micro_batches_called_off": self.num_skipped
                               + self.busy.num_called_off,
                               "in_pieces": self.in_pieces,
                               "busy_pieces": self.busy.num_pieces,
                               "busy_piece_ms": round(self.busy.piece_s * 1e3, 2)
                               if self.busy.piece_s else None,
                               "busy_piece_s": round(self.busy.busy_s, 3),
                               "gap_piece_s": round(self.busy.gap_s, 3),
                               # runs of pieces stopped for a request: how long until they did
                               "stop_wait_ms": self.busy.stop_wait_ms(),
                               "take_backs": self.num_take_backs,
                               "take_back_ms": None if self.take_back_s is None
                               else round(self.take_back_s * 1e3, 1)}}
