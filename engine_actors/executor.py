"""Placement group and worker actors; dispatches each step message to every worker.

One bundle (one GPU) per worker, P stages of T ranks: worker i is tensor-parallel rank
i % T of stage i // T. Nothing here assumes one node or a bound on P x T:
`placement_strategy` decides how bundles spread over nodes.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time

import ray
from ray.util.placement_group import (placement_group, placement_group_table,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine_actors.checkpoint import ModelInfo, resolve_model_path
from engine_actors.config import EngineConfig
from engine_actors.messages import StepInput
from engine_actors.prefetch import prefetch
from engine_actors.worker import Worker

# Every process we start inherits these; NVLink multicast must stay off on shared hosts.
# Ray shows each worker only its own GPU, so every rank calls its GPU device 0: symmetric
# memory (the one-shot all-reduce's peer buffers) must not take that for a shared device.
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}


def resolve_device(cfg: EngineConfig) -> str:
    """`auto` means cuda when the cluster has a GPU for every worker."""
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= cfg.num_workers else "cpu"


def start_failure_cause(e: Exception) -> str:
    """One line: the error a worker raised, without Ray's wrapping and traceback."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    elif isinstance(e, ray.exceptions.RayActorError):
        return f"a worker died while starting: {e.error_msg.splitlines()[0]}"
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _remove_stale_placement_group(name: str) -> None:
    """A placement group belongs to the job, not to the actor that made it: one left by a
    scheduler that died still holds its devices. Free it before asking for them again."""
    try:
        stale = ray.util.get_placement_group(name)
    except ValueError:
        return
    remove_placement_group(stale)


class PhaseClock:
    """Seconds spent in each named phase of a start, in order."""

    def __init__(self, phases: dict[str, float] | None = None):
        self.phases: dict[str, float] = dict(phases or {})
        self._last = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = now - self._last
        self._last = now


def worker_bundle(cfg: EngineConfig, device: str) -> dict:
    """One worker's resources: a GPU (of `accelerator_type`, as Ray Serve LLM asks for it:
    a sliver of the node's "accelerator_type:<type>" resource) or CPUs."""
    bundle = {"CPU": cfg.num_cpus_per_worker}
    if device == "cuda":
        bundle["GPU"] = 1
        if cfg.accelerator_type:
            bundle[f"accelerator_type:{cfg.accelerator_type}"] = 0.001
    elif cfg.accelerator_type:
        raise ValueError(f"accelerator_type {cfg.accelerator_type} needs GPU workers; this "
                         "engine's device is cpu")
    elif cfg.num_cpus_per_worker <= 0:
        raise ValueError("num_cpus_per_worker must be > 0 when device is cpu")
    return bundle


class Executor:
    def __init__(self, cfg: EngineConfig, device: str, name: str = ""):
        """Place the workers and start their processes (start() then sets them up)."""
        self.cfg = cfg
        self.device = device
        bundle = worker_bundle(cfg, device)
        self._step_ids = itertools.count()
        self.name = name
        self._placed = False
        self._stop_prefetch = threading.Event()  # set: a read-ahead of the weights stops
        if name:
            _remove_stale_placement_group(name)
        self.placement_group = placement_group([bundle] * cfg.num_workers,
                                               strategy=cfg.placement_strategy, name=name)
        remote_worker = ray.remote(Worker)
        self.workers = [
            remote_worker.options(
                num_cpus=cfg.num_cpus_per_worker, num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=i),
                runtime_env={"env_vars": WORKER_ENV},
                enable_task_events=False,  # see SchedulerActor's options
            ).remote(cfg, device, i)
            for i in range(cfg.num_workers)]
        # the last stage's first rank returns the sampled tokens
        self.result_index = (cfg.pipeline_parallel_size - 1) * cfg.tensor_parallel_size

    async def place(self, clock: PhaseClock) -> None:
        """Wait until the placement group is placed; then, if a worker is on this node,
        start reading the weight files into the page cache while the workers start."""
        if self._placed:
            return
        timeout_s = self.cfg.placement_timeout_s
        try:
            await asyncio.wait_for(self.placement_group.ready(), timeout_s)
        except asyncio.TimeoutError:
            total, free = ray.cluster_resources(), ray.available_resources()
            have = ", ".join(f"{k} {free.get(k, 0):g} free of {total[k]:g}"
                             for k in ("CPU", "GPU") if k in total)
            raise RuntimeError(
                f"the workers' placement group ({len(self.workers)} x "
                f"{self.placement_group.bundle_specs[0]}, {self.cfg.placement_strategy}) was not "
                f"placed within placement_timeout_s={timeout_s:g}: the cluster has {have}. "
                "Lower num_cpus_per_worker or the parallel sizes, or add nodes") from None
        clock.lap("placement")
        self._placed = True
        if self._places_a_worker_here():
            prefetch(resolve_model_path(self.cfg.model), self._stop_prefetch)

    async def start(self, info: ModelInfo, num_blocks: int | None = None,
                    clock: PhaseClock | None = None) -> int:
        """Wait for the workers to load the model (`info`: its length and config); size and
        allocate the KV pool.

        Returns the number of KV blocks: `num_blocks` if given (a replacement group must
        match the scheduler's bookkeeping), else the smallest any worker can hold. `clock`
        gets the time of each phase.
        """
        clock = clock or PhaseClock()
        await self.place(clock)
        await asyncio.gather(*[w.__ray_ready__.remote() for w in self.workers])
        clock.lap("workers")
        address = await self.workers[0].address.remote() if len(self.workers) > 1 else ""
        await asyncio.gather(*[w.setup.remote(info.max_model_len, address, info.config)
                               for w in self.workers])
        clock.lap("weights")
        if num_blocks is None:
            num_blocks = min(await asyncio.gather(*[w.num_kv_blocks.remote()
                                                    for w in self.workers]))
            clock.lap("KV profile")
        await asyncio.gather(*[w.init_kv_cache.remote(num_blocks) for w in self.workers])
        await asyncio.gather(*[w.freeze_heap.remote() for w in self.workers])
        clock.lap("KV pool and CUDA graphs" if self.device == "cuda" else "KV pool")
        return num_blocks

    def _places_a_worker_here(self) -> bool:
        nodes = placement_group_table(self.placement_group).get("bundles_to_node_id", {})
        return ray.get_runtime_context().get_node_id() in nodes.values()

    async def execute(self, step: StepInput) -> list[int]:
        """Send one step to every worker (one shared copy of the message); wait for all of
        them, so a failure anywhere fails the step instead of leaving a stage waiting."""
        step.step_id = next(self._step_ids)
        step_ref = ray.put(step)
        refs = [w.execute.remote(step_ref) for w in self.workers]
        results = await asyncio.gather(*refs)
        return results[self.result_index]

    async def finetune(self, method: str, *args):
        """A fine-tuning call on every worker (its ranks train together: see
        engine_actors/finetune.py); the first worker's answer, with the least free memory
        of any worker (a step needs its memory on each). It takes its turn among the steps
        (its number from theirs), so that every rank runs steps and training in one order."""
        turn = next(self._step_ids)
        results = await asyncio.gather(*[w.finetune.remote(method, *args, turn=turn)
                                         for w in self.workers])
        out = results[0]
        if isinstance(out, dict) and out.get("free_bytes") is not None:
            out = {**out, "free_bytes": min(r["free_bytes"] for r in results)}
        return out

    def skip_training(self, seq: int) -> None:
        """The fine-tuning micro-batch `seq`, sent ahead, is skipped if it has not started
        (a request came); not waited for."""
        for w in self.workers:
            w.skip_training.remote(seq)

    def stop_training(self, run: int) -> None:
        """Runs of fine-tuning pieces numbered up to `run` stop after their current piece
        (a request came); not waited for."""
        for w in self.workers:
            w.stop_training.remote(run)

    async def all_alive(self, timeout_s: float = 5.0) -> bool:
        try:
            await asyncio.wait_for(asyncio.gather(*[w.__ray_ready__.remote()
                                                    for w in self.workers]), timeout_s)
            return True
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return False

    async def inject_fault(self, worker_index: int) -> None:
        await self.workers[worker_index].fail_next_step.remote()

    async def step_traces(self) -> list[list[tuple]]:
        return await asyncio.gather(*[w.step_trace.remote() for w in self.workers])

    async def gpu_timeline(self, reset: bool = False) -> list[dict]:
        return await asyncio.gather(*[w.gpu_timeline.remote(reset) for w in self.workers])

    def shutdown(self) -> None:
        self._stop_prefetch.set()
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.placement_group)
