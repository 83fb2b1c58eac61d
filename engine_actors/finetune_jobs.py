"""Fine-tuning jobs in the GPU's idle time: FineInfer's deferred continuous batching.

The scheduler actor keeps the uploaded training files and the jobs (OpenAI's shapes), one
job training at a time, the others queued. Between inference iterations the engine loop
asks `wants_step`: a fine-tuning micro-batch runs when no request is running and every
waiting request can still be deferred, i.e. its time in the queue plus the estimated time
of one fine-tuning step stays within `finetune_deferral_ms` (FineInfer §2.4); otherwise
inference runs. Step times are measured (an exponential average). The micro-batch runs
on the worker (`engine_actors/finetune.py`); when the last step is done the adapter is
saved in PEFT's format and served at once under the job's `fine_tuned_model`.

Memory: a micro-batch needs device memory for its activations, measured per token after
each step (until then a micro-batch is one example, and an estimate from the model's size
stands in). When the memory free beside the KV pool is short, the KV manager lends the
workers free blocks at the end of the pool, whose memory they release for the step
(kv_memory.py): cached prefix blocks there are evicted; blocks of running requests and
reserved ones are never taken. The micro-batch shrinks to what is free. The blocks come
back when inference runs again.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid

import ray

from engine_actors.finetune_job import Job
from engine_actors.messages import Refusal

logger = logging.getLogger("orca_serve.finetune")
MAX_FILE_BYTES = 64 * 1024 * 1024
MEMORY_MARGIN = 1.25  # over the measured peak memory per token
MEMORY_RETRY_S = 0.1  # when no example fits in the memory free now, ask again this much later


def may_defer(waited_s: list[float], step_s: float | None, bound_s: float) -> bool:
    """FineInfer's rule: requests waiting `waited_s` may wait for one more fine-tuning step
    (of estimated `step_s`; None: not measured yet, so only when none waits)."""
    if not waited_s:
        return True
    return step_s is not None and max(waited_s) + step_s <= bound_s


class FineTuning:
    """The scheduler actor's files and jobs, and the steps it runs for them."""

    def __init__(self, cfg, adapters, metrics=None):
        self.cfg, self.adapters, self.metrics = cfg, adapters, metrics
        self.dir = cfg.finetune_dir or tempfile.mkdtemp(prefix="orca-finetune-")
        self.files: dict[str, tuple[dict, bytes]] = {}
        self.jobs: dict[str, Job] = {}
        self.queue: list[Job] = []  # queued and running, oldest first
        self.step_s: float | None = None  # measured time of one step, averaged
        self.bound_s = cfg.finetune_deferral_ms / 1e3
        self.memory: dict | None = None  # the worker's: free bytes, how the KV pool lends
        self.bytes_per_token: float | None = None  # a micro-batch's peak, measured
        self.retry_at = 0.0  # no micro-batch fitted in memory: not before then

    # ---- files --------------------------------------------------------------------------
    def add_file(self, filename: str, purpose: str, content: bytes) -> dict:
        meta = {"object": "file", "id": f"file-{uuid.uuid4().hex[:24]}", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename, "purpose": purpose,
                "status": "processed"}
        self.files[meta["id"]] = (meta, content)
        return meta

    def file(self, file_id: str, content: bool = False):
        entry = self.files.get(file_id)
        return None if entry is None else entry[1] if content else entry[0]

    # ---- jobs ---------------------------------------------------------------------------
    def create(self, spec: dict) -> dict | Refusal:
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

    def list_jobs(self) -> list[dict]:
        return [j.to_dict() for j in sorted(self.jobs.values(), key=lambda j: -j.created_at)]

    def events(self, job_id: str) -> list[dict] | None:
        job = self.jobs.get(job_id)
        return None if job is None else list(reversed(job.events))  # newest first, as OpenAI

    async def cancel(self, job_id: str, executor) -> dict | Refusal | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job.status not in ("queued", "running"):
            return Refusal("invalid_state", f"job {job_id} is already {job.status}")
        self._end(job, "cancelled")
        job.event("Fine-tuning job cancelled")
        await self._drop(job, executor)
        return job.to_dict()

    # ---- the engine loop's side ---------------------------------------------------------
    def wants_step(self, scheduler, now: float) -> bool:
        if not self.queue or scheduler.num_running or now < self.retry_at:
            return False
        return may_defer([now - r.arrival_time for r in scheduler.waiting], self.step_s,
                         self.bound_s)

    def plan_memory(self, kv, tokens: int) -> tuple[int, int]:
        """(KV units to lend in all, the token cap of the next micro-batch) for a micro-batch
        of up to `tokens` tokens."""
        m = self.memory
        if m["free_bytes"] is None:  # CPU: not bounded by the device
            return 0, tokens
        per_token = MEMORY_MARGIN * (self.bytes_per_token or m["bytes_per_token_guess"])
        cap = tokens
        unit_bytes = m["lend_unit_bytes"]
        units = kv.num_lent_blocks // m["lend_unit_blocks"]  # lent for an earlier step
        short = per_token * cap - m["free_bytes"] - units * unit_bytes
        if short > 0 and unit_bytes:
            units = kv.lend(units + -(-int(short) // unit_bytes), m["lend_unit_blocks"],
                            m["lendable_units"])
        return units, min(cap, int((m["free_bytes"] + units * unit_bytes) / per_token))

    async def step(self, executor, kv) -> None:
        """One micro-batch of the oldest job; its end (saved and served) after the last.
        `kv`: the scheduler's KV manager, which lends blocks for the step's memory."""
        job = self.queue[0]
        start = time.monotonic()
        try:
            if not job.started:
                job.started, job.status = True, "running"
                lora = job.lora
                self.memory = await executor.finetune("start", job.id, lora["r"], lora["alpha"],
                                                      lora["target_modules"], job.learning_rate,
                                                      job.seed)
                job.event("Fine-tuning job started")
            # until its memory per token is measured, a job's micro-batch is one example
            tokens = self.cfg.finetune_max_tokens if self.bytes_per_token is not None \
                or self.memory["free_bytes"] is None else job.next_length()
            units, cap = self.plan_memory(kv, tokens)
            planned = job.next_micro(cap)
            if planned is None:  # no example fits in the memory free now
                self.retry_at = time.monotonic() + MEMORY_RETRY_S
                return
            micro, loss_tokens, last = planned
            out = await executor.finetune("micro_step", job.id, units,
                                          [job.examples[i][0] for i in micro],
                                          [job.examples[i][1] for i in micro], loss_tokens, last)
        except (ray.exceptions.RayError, ValueError) as e:
            cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e
            if job.status == "running":  # not cancelled meanwhile
                self._fail(job, f"{type(cause).__name__}: {cause}".splitlines()[0])
            await self._drop(job, executor)
            return
        self.memory = {**self.memory, "free_bytes": out["free_bytes"]}
        if out["peak_bytes"] is not None:
            self.bytes_per_token = max(self.bytes_per_token or 0.0,
                                       out["peak_bytes"] / out["tokens"])
        elapsed = time.monotonic() - start
        self.step_s = elapsed if self.step_s is None else 0.8 * self.step_s + 0.2 * elapsed
        if self.metrics is not None:
            self.metrics.finetune_steps.inc()
            self.metrics.finetune_tokens.inc(out["tokens"])
            self.metrics.finetune_step_time.observe(elapsed)
        if job.status != "running":
            return  # cancelled while the step ran
        loss = job.record(out["tokens"], out["loss_sum"], last)
        if loss is not None:
            job.event(f"Step {job.steps_done}/{job.total_steps}: training loss={loss:.4f}",
                      {"step": job.steps_done, "total_steps": job.total_steps,
                       "train_loss": loss, "trained_tokens": job.trained_tokens})
            if job.steps_done == job.total_steps:
                await self._finish(job, executor)

    async def _finish(self, job: Job, executor) -> None:
        name = f"ft:{self.cfg.model_name}:{job.suffix or 'orca'}:{job.id[len('ftjob-'):][:8]}"
        path = os.path.join(self.dir, job.id)
        try:
            await executor.finetune("save", job.id, path, self.cfg.model)
        except ray.exceptions.RayError as e:
            self._fail(job, f"saving the adapter failed: {e}".splitlines()[0])
        else:
            refusal = self.adapters.load(name, path)
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
        if job in self.queue:
            self.queue.remove(job)

    async def _drop(self, job: Job, executor) -> None:
        """Free the job's trainer (parameters, gradients, optimizer state) on the worker."""
        if job.started:
            job.started = False
            try:
                await executor.finetune("drop", job.id)
            except ray.exceptions.RayError as e:  # the worker is gone, and its memory too
                logger.warning("freeing fine-tuning job %s's trainer failed: %s", job.id,
                               str(e).splitlines()[0] if str(e) else type(e).__name__)

    def stats(self) -> dict:
        running = self.queue[0].id if self.queue and self.queue[0].started else None
        return {"finetuning": {"running_job": running, "queued_jobs": len(self.queue) - bool(running),
                               "step_ms_estimate": None if self.step_s is None
                               else round(self.step_s * 1e3, 1),
                               "bytes_per_token": self.bytes_per_token}}
