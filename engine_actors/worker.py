"""The worker: owns one device and one model shard, runs exactly one iteration per call.

An async actor: `execute` enqueues the step on the device and then awaits its result in a
thread, so the next step message is accepted and enqueued while the device still runs this
one (the control plane never leaves the GPU idle). Steps run in step_id order whatever
order Ray delivers them in. With pipeline stages every worker gets every step message at
once: a stage enqueues its receive of the previous stage's activations and moves on,
without waiting for that stage (ORCA's control/data plane separation). The executor wraps
this class with `ray.remote`; tests can use it in-process. Its fine-tuning calls are in
worker_training.py.
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
from engine_actors.kv_profile import profile_kv_blocks
from engine_actors.model_loader import resolve_dtype
from engine_actors.model_runner import ModelRunner
from engine_actors.parallel import ONE_SHOT_MAX_BYTES, SINGLE, free_address, init_parallel
from engine_actors.worker_training import TrainingCalls

CPU_KV_TOKENS = 16384  # default KV pool on CPU when max_num_tokens is not given


class Worker(TrainingCalls):
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
        self.init_training()

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

    def step_trace(self) -> list[tuple]:
        return list(self.trace)

    def fail_next_step(self) -> None:
        """Chaos testing: the next step raises inside the model's forward pass."""
        self.runner.fail_next = True
