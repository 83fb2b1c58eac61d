"""The worker: owns one device and one model shard, runs exactly one iteration per call.

The executor wraps this class with `ray.remote` inside the placement group; tests can use
it in-process.
"""
from __future__ import annotations

import os

import torch

from engine_actors.checkpoint import resolve_model_path
from engine_actors.config import EngineConfig
from engine_actors.kv_cache import cdiv
from engine_actors.messages import StepInput
from engine_actors.model_runner import ModelRunner, resolve_dtype

CPU_KV_TOKENS = 16384  # default KV pool on CPU when max_num_tokens is not given


class Worker:
    def __init__(self, cfg: EngineConfig, device: str, max_model_len: int, max_num_seqs: int):
        if device == "cpu" and cfg.num_cpus_per_worker >= 1:
            torch.set_num_threads(int(cfg.num_cpus_per_worker))
        self.cfg = cfg
        self.device = device
        self.runner = ModelRunner(resolve_model_path(cfg.model), device,
                                  resolve_dtype(cfg.dtype, device), max_model_len,
                                  cfg.block_size, max_num_seqs, cfg.seed)

    def pid(self) -> int:
        return os.getpid()

    def num_kv_blocks(self) -> int:
        """How many KV blocks this worker can hold."""
        if self.cfg.max_num_tokens is not None:
            return cdiv(self.cfg.max_num_tokens, self.cfg.block_size)
        if self.device == "cpu":
            return cdiv(CPU_KV_TOKENS, self.cfg.block_size)
        free, total = torch.cuda.mem_get_info()
        used = total - free  # weights, the CUDA context and anything else on the GPU
        activations = self._profile_activation_bytes()
        budget = total * self.cfg.gpu_memory_utilization - used - activations
        blocks = int(budget // self.runner.kv_bytes_per_block())
        if blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} "
                               "GiB); raise gpu_memory_utilization or use a smaller model")
        return blocks

    def _profile_activation_bytes(self) -> int:
        """Peak memory of the largest iteration (one prompt of max_num_batched_tokens)."""
        n = min(self.cfg.max_num_batched_tokens, self.runner.max_model_len)
        blocks = cdiv(n, self.cfg.block_size)
        self.runner.allocate_kv_cache(blocks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step = StepInput(step_id=-1, rows=[0], context_lens=[0], query_lens=[n], sample=[True],
                         token_ids=[0] * n, table_rows=[0] * blocks, table_cols=list(range(blocks)),
                         table_blocks=list(range(blocks)))
        self.runner.execute(step)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        self.runner.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, step: StepInput) -> list[int]:
        return self.runner.execute(step)
