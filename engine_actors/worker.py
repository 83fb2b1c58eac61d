"""The worker: owns one device and one model shard, runs exactly one iteration per call.

An async actor: `execute` enqueues the step on the device and then awaits its result in a
thread, so the next step message is accepted and enqueued while the device still runs this
one (the control plane never leaves the GPU idle). Steps run in step_id order whatever
order Ray delivers them in. With pipeline stages every worker gets every step message at
once: a stage enqueues its receive of the previous stage's activations and moves on,
without waiting for that stage (ORCA's control/data plane separation). The executor wraps
this class with `ray.remote`; tests can use it in-process.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import time

import torch

from engine_actors.checkpoint import resolve_model_path
from engine_actors.config import EngineConfig
from engine_actors.kv_cache import cdiv
from engine_actors.messages import StepInput
from engine_actors.finetune import Trainer
from engine_actors.finetune_memory import training_memory
from engine_actors.finetune_pieces import Pieces
from engine_actors.kv_profile import profile_kv_blocks
from engine_actors.model_loader import resolve_dtype
from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ONE_SHOT_MAX_BYTES, SINGLE, free_address, init_parallel

CPU_KV_TOKENS = 16384  # default KV pool on CPU when max_num_tokens is not given


class Worker:
    def __init__(self, cfg: EngineConfig, device: str, rank: int = 0):
        if device == "cpu":
            torch.set_num_threads(max(1, int(cfg.num_cpus_per_worker)))
        self.cfg, self.device, self.rank = cfg, device, rank
        self.max_model_len = 0  # set by setup
        self.runner: ModelRunner | None = None
        self._next_step = 0
        self._turn: asyncio.Condition | None = None
        # launches run here, one at a time in step order: a launch may block its thread (a
        # collective, an allocation) without stalling the loop that returns finished steps
        self._launcher = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        # wall-clock (arrived, launched, enqueued, done) of the latest steps, for diagnosis
        self.trace: collections.deque = collections.deque(maxlen=256)
        self.trainers: dict[str, Trainer] = {}  # fine-tuning jobs' LoRA training state
        self._skip: set[int] = set()  # micro-batches called off (skip_training)
        self._train_seen = -1  # the latest micro-batch handed to the launch thread
        self._train_turn = asyncio.Condition()  # bound to the actor's loop at first use
        self._held = 0  # bytes the caching allocator holds and cannot give back (CUDA)
        self.pieces: tuple[str, Pieces] | None = None  # (job, micro-batch) run in pieces
        self._piece_base = 0  # memory allocated before it
        self._stop = 0  # runs of pieces numbered up to this stop after their current piece

    def address(self) -> str:
        """host:port for the process group's rendezvous (asked of rank 0)."""
        return free_address()

    def setup(self, max_model_len: int, address: str = "", config: dict | None = None) -> None:
        """Join the process group (all workers at once; a single worker has none), then load
        this shard of the model (`config`: ModelInfo.config). Every worker's one set-up."""
        cfg = self.cfg
        self.max_model_len = max_model_len
        parallel = init_parallel(address, self.rank, cfg.tensor_parallel_size,
                                 cfg.pipeline_parallel_size, self.device,
                                 cfg.distributed_timeout_s,
                                 0 if cfg.disable_custom_all_reduce else ONE_SHOT_MAX_BYTES) \
            if cfg.num_workers > 1 else SINGLE
        lora = (cfg.max_loras, cfg.max_lora_rank) if cfg.lora_enabled else None
        self.runner = ModelRunner(resolve_model_path(cfg.model), self.device,
                                  resolve_dtype(cfg.dtype, self.device), self.max_model_len,
                                  cfg.block_size, cfg.max_num_seqs, cfg.seed, cfg.uses_cuda_graphs,
                                  parallel, lora, cfg.runner == "pooling", cfg.quantization,
                                  config, cfg.classifier_from_token, cfg.kv_cache_dtype)
        self.runner.allocate_stage_buffers(max(cfg.max_num_batched_tokens, cfg.max_batch_size),
                                           cfg.max_steps_in_flight, cfg.async_scheduling)

    def num_kv_blocks(self) -> int:
        """How many KV blocks this worker can hold (collective with several workers: the
        profiling pass runs a real step through every stage)."""
        cfg = self.cfg
        if cfg.max_num_tokens is not None:
            return cdiv(cfg.max_num_tokens, cfg.block_size)
        if self.device == "cpu":
            return cdiv(CPU_KV_TOKENS, cfg.block_size)
        graph_batch = min(cfg.max_batch_size, cfg.max_num_seqs, 512) if cfg.uses_cuda_graphs else 0
        return profile_kv_blocks(self.runner, cfg, graph_batch)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs(self.cfg.max_batch_size, self.cfg.max_num_batched_tokens,
                                        1 + self.cfg.max_drafts)

    def freeze_heap(self) -> None:
        """Called in the actor once it is set up: full collections under load no longer
        scan the startup heap (not in-process, where it would freeze the caller's)."""
        gc.collect()
        gc.freeze()

    def gpu_timeline(self, reset: bool = False) -> dict:
        """GPU busy time and idle time between steps since the last reset (CUDA only)."""
        timeline = self.runner.timeline
        if timeline is None:
            return {}
        stats = timeline.collect()
        # the allocator's cache flushes (each waits for the device): a step that needed
        # more memory than profiled
        stats["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        if reset:
            timeline.reset()
        return stats

    async def execute(self, step: StepInput) -> list[int]:
        if self._turn is None:
            self._turn = asyncio.Condition()
        arrived = time.time()
        async with self._turn:
            await self._turn.wait_for(lambda: self._next_step == step.step_id)
            launched = time.time()
            launch = asyncio.get_running_loop().run_in_executor(self._launcher,
                                                                self.runner.launch, step)
            self._next_step += 1
            self._turn.notify_all()
        pending = await launch
        enqueued = time.time()
        await asyncio.to_thread(pending.wait)
        self.trace.append((step.step_id, arrived, launched, enqueued, time.time()))
        return pending.result()

    async def finetune(self, method: str, job_id: str, *args, turn: int | None = None):
        """A fine-tuning job's `start`, `micro_step`, `piece`, `save` or `drop` (engine_actors/
        finetune.py), on the launch thread. `turn`: the call's place among the steps (the
        executor numbers both), so that every rank runs steps and training in one order
        (their collectives must match). Without it (tests in-process), a micro-batch sent
        ahead names the one it follows (`after`), and goes to the thread only after it: an
        async actor may start calls out of their order."""
        loop = asyncio.get_running_loop()
        if turn is not None:
            if self._turn is None:
                self._turn = asyncio.Condition()
            async with self._turn:
                await self._turn.wait_for(lambda: self._next_step == turn)
                launch = loop.run_in_executor(self._launcher, self._finetune, method, job_id,
                                              *args)
                self._next_step += 1
                self._turn.notify_all()
            out = await launch
            return await self._piece_done(*out) if method == "piece" else out
        if method != "micro_step":
            return await loop.run_in_executor(self._launcher, self._finetune, method, job_id,
                                              *args)
        seq, after = args[0], args[1]
        async with self._train_turn:
            await self._train_turn.wait_for(lambda: after < 0 or self._train_seen >= after)
            self._train_seen = max(self._train_seen, seq)
            launch = loop.run_in_executor(self._launcher, self._finetune, method, job_id, *args)
            self._train_turn.notify_all()
        return await launch

    def _finetune(self, method: str, job_id: str, *args):
        if method == "start":
            self.trainers[job_id] = Trainer(self.runner.model, *args)
            if self.device == "cuda":  # what the allocator holds and cannot give back
                torch.cuda.empty_cache()  # (the graphs' pools): not free for training
                self._held = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            return self._training_memory()
        if method == "micro_step":  # args: its number, the one it follows (-1: none), the
            if self._lend(args[2], args[0]):  # KV units to lend, the batch
                return {"skipped": True, **self._training_memory()}
            out = self.trainers[job_id].micro_step(*args[3:])
            return {**out, **self._training_memory()}
        if method == "piece":
            return self._piece(job_id, *args)
        if method == "call_off":  # the micro-batch in pieces: its activations freed
            self.pieces = None
            return None
        if method == "take_back":  # the lent KV blocks, mapped again before inference
            self.runner.kv_memory.take_back()
        elif method == "drop":
            self.trainers.pop(job_id, None)
            if self.pieces is not None and self.pieces[0] == job_id:
                self.pieces = None
            if self.device == "cuda":
                torch.cuda.empty_cache()
        elif method == "resident":  # job id -> bytes of its parameters and optimizer state
            return {j: t.state_bytes() for j, t in self.trainers.items()}
        else:
            return getattr(self.trainers[job_id], method)(*args)

    def _piece(self, job_id: str, run: int, count: int, *batch):
        """Launch up to `count` pieces of a micro-batch in pieces (finetune_pieces.py), back
        to back, fewer when it ends or run `run` is told to stop (`stop_training`: a request
        came). `batch` (KV units lent to it, sequences, masks, the batch's trained tokens,
        whether it is the batch's last) starts a new one. Returns what `_piece_done`
        completes, and the CUDA events around the pieces (None on CPU)."""
        cuda = self.device == "cuda"
        if batch:
            self._lend(batch[0])
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                self._piece_base = torch.cuda.memory_allocated()
            self.pieces = (job_id, Pieces(self.trainers[job_id], *batch[1:]))
        pieces = self.pieces[1]
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        start = time.perf_counter()
        if cuda:
            events[0].record()
        ran, done = 0, False
        try:  # (a run may stop before its first piece: a request came as it was sent)
            while not done and ran < count and not (pieces.wait_queued() or count > 1
                                                    and self._stopping(run)):
                done = pieces.run_next()
                ran += 1
        except Exception:
            self.pieces = None  # its activations freed
            raise
        out = {"done": done, "left": pieces.num_pieces, "ran": ran, "host_s": 0.0}
        if done:
            self.pieces = None
            out.update(loss_sum=pieces.loss_sum.to("cpu", non_blocking=True),
                       loss_tokens=pieces.loss_tokens, tokens=pieces.tokens,
                       peak_bytes=torch.cuda.max_memory_allocated() - self._piece_base
                       if cuda else None, **self._training_memory())
        if cuda:
            events[1].record()
        out["host_s"] = time.perf_counter() - start
        return out, events

    def _lend(self, units: int, seq: int = -1) -> bool:
        """Free the memory of `units` KV units for training (kv_memory.py). The tensor-
        parallel ranks agree first whether any failed (raised then on all, so none is left
        alone in a later collective), and whether micro-batch `seq` was called off (True)."""
        try:
            self.runner.kv_memory.lend(units)
            error = None
        except Exception as e:
            error = e
        skip, failed = self._agree(seq, error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("lending KV memory to training failed on another "
                               "tensor-parallel rank")
        return skip

    def _stopping(self, run: int) -> bool:
        """Whether run `run` of pieces stops now, as the tensor-parallel ranks agree (each
        asks after the same pieces; one that heard of the stop decides for all)."""
        stop = self._stop >= run
        if self.runner.parallel.tp_size > 1:
            flag = torch.tensor([float(stop)], device=self.runner.model.embed_tokens.weight.device)
            stop = bool(self.runner.parallel.all_reduce(flag).item())
        return stop

    async def stop_training(self, run: int) -> None:
        """Runs of pieces numbered up to `run` stop after their current piece (a request
        came). On the actor's loop, so it lands while the launch thread trains."""
        self._stop = max(self._stop, run)

    async def _piece_done(self, out: dict, events) -> dict:
        """A run of pieces' answer once the device has run it: its device time (`gpu_s`;
        its host time on CPU) and, after the micro-batch's last piece, its loss."""
        out["gpu_s"] = out["host_s"]
        if events is not None:
            await asyncio.to_thread(events[1].synchronize)
            out["gpu_s"] = events[0].elapsed_time(events[1]) / 1e3
        if out["done"]:
            out["loss_sum"] = float(out["loss_sum"])
        return out

    async def skip_training(self, seq: int) -> None:
        """Micro-batch `seq` (sent ahead) is not to run if it has not started. On the
        actor's loop, so it lands while the launch thread trains."""
        self._skip.add(seq)

    def _agree(self, seq: int, failed: bool) -> tuple[bool, bool]:
        """(whether micro-batch `seq` was called off, whether its preparation failed) as
        the tensor-parallel ranks agree: any rank that heard of the call-off, or failed,
        decides for all, so they all run it or none does (a rank alone in a collective
        would wait forever)."""
        skip = seq in self._skip
        self._skip = {s for s in self._skip if s > seq}  # later ones only (seq grows)
        if self.runner.parallel.tp_size > 1:
            flags = torch.tensor([float(skip), float(failed)],
                                 device=self.runner.model.embed_tokens.weight.device)
            skip, failed = (bool(f) for f in self.runner.parallel.all_reduce(flags).tolist())
        return skip, failed

    def _training_memory(self) -> dict:
        return training_memory(self.runner, self.device, self._held)

    def step_trace(self) -> list[tuple]:
        return list(self.trace)

    def fail_next_step(self) -> None:
        """Chaos testing: the next step raises inside the model's forward pass."""
        self.runner.fail_next = True
