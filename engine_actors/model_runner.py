"""One iteration on one device: step message -> flattened tensors -> model -> sampled ids.

`launch()` only enqueues work: the step's integers go to the device in one pinned,
non-blocking copy, the sampled ids come back in one non-blocking copy, and the returned
`PendingStep` is waited on separately, so the worker can accept and enqueue the next step
while the device still runs this one. Decode-only steps replay a CUDA graph captured for
the smallest batch-size bucket that fits; other steps run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_actors.checkpoint import iter_checkpoint_tensors, load_hf_config
from engine_actors.kv_cache import cdiv
from engine_actors.layers.attention import AttentionMetadata
from engine_actors.messages import StepInput
from engine_actors.models.llama import LlamaForCausalLM
from engine_actors.sampler import Sampler
from engine_actors.transfer import PendingStep, to_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAPH_BATCH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384,
                     448, 512]


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return DTYPES[dtype]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # output buffer, [bucket, V]


class ModelRunner:
    def __init__(self, model_path: str, device: str, dtype: torch.dtype, max_model_len: int,
                 block_size: int, max_num_seqs: int, seed: int, use_cuda_graphs: bool = True):
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.hf_config = load_hf_config(model_path)
        self.model = self._load_model(model_path)
        cfg = self.hf_config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Row r holds the block ids of the request admitted at row r, in position order.
        # The extra last row is the padding row of CUDA-graph batches: every entry points
        # at a scratch block, so padding tokens write their keys/values there.
        self.pad_row = max_num_seqs
        self.block_table = torch.zeros(max_num_seqs + 1, cdiv(max_model_len, block_size),
                                       dtype=torch.int32, device=self.device)
        self.last_sampled = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.sampler = Sampler(max_num_seqs, self.device, seed)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[int, _Graph] = {}
        self.num_graph_replays = 0
        self.timeline = StepTimeline() if self.device.type == "cuda" else None

    def _load_model(self, path: str) -> LlamaForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.hf_config, self.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        loaded = {model.load_weight(name, tensor.to(self.dtype))
                  for name, tensor in iter_checkpoint_tensors(path, self.device)}
        missing = model.weight_keys() - loaded
        if missing:
            raise ValueError(f"checkpoint {path} lacks weights for {sorted(missing)[:8]}")
        return model.eval()

    # ---- KV cache -----------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.hf_config.num_hidden_layers * self.block_size * self.num_kv_heads \
            * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks usable blocks plus one scratch block (id num_blocks) for padding."""
        shape = ((num_blocks + 1) * self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.hf_config.num_hidden_layers)]
        self.block_table[self.pad_row] = num_blocks
        self.graphs = {}

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """Enqueue one iteration; the PendingStep yields one token per row with sample=True."""
        if self.timeline is not None:
            self.timeline.begin()
        logits, inputs = self.forward(step)
        sampled = self.sampler(logits, inputs.sample_rows_host, inputs.sample_rows)
        self.last_sampled[inputs.sample_rows] = sampled.to(torch.int32)
        pending = PendingStep(sampled)
        if self.timeline is not None:
            self.timeline.end()
        return pending

    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor, _Inputs]:
        """Apply the step's table deltas and run the model: fp32 logits [N, V] of the N
        sampling requests (graph replay for decode-only steps that fit a captured bucket)."""
        self.sampler.add(step.new_requests)
        num_reqs = len(step.rows)
        bucket = self._graph_bucket(step)
        inputs = self._prepare(step, pad_to=bucket or num_reqs)
        if inputs.table_rows.numel():
            self.block_table[inputs.table_rows, inputs.table_cols] = inputs.table_blocks
        # -1 placeholders: the token this row's previous step sampled, still on the device
        input_ids = torch.where(inputs.input_ids >= 0, inputs.input_ids,
                                self.last_sampled[inputs.token_rows])
        meta = AttentionMetadata(
            cu_seqlens_q=inputs.cu_seqlens_q, seq_lens=inputs.seq_lens,
            block_tables=self.block_table[inputs.rows],
            slot_mapping=self._slot_mapping(inputs.token_rows, inputs.positions),
            block_size=self.block_size, max_query_len=inputs.max_query_len)
        if bucket:
            self.num_graph_replays += 1
            logits = self._replay(bucket, input_ids, inputs.positions, meta)[:num_reqs]
        else:
            logits = self.model(input_ids, inputs.positions, self.kv_caches, meta,
                                inputs.logits_indices)
        return logits, inputs

    def execute(self, step: StepInput) -> list[int]:
        return self.launch(step).result()

    def _slot_mapping(self, token_rows, positions):
        blocks = self.block_table[token_rows, positions // self.block_size]
        return blocks.long() * self.block_size + positions % self.block_size

    def _prepare(self, step: StepInput, pad_to: int) -> _Inputs:
        """Every integer of the step in one host array and one copy, then device views."""
        query_lens = np.asarray(step.query_lens, dtype=np.int32)
        context_lens = np.asarray(step.context_lens, dtype=np.int32)
        rows = np.asarray(step.rows, dtype=np.int32)
        num_pad = pad_to - len(rows)
        if num_pad:  # graph padding: empty requests whose one token lands in the scratch block
            query_lens = np.concatenate([query_lens, np.zeros(num_pad, np.int32)])
            context_lens = np.concatenate([context_lens, np.zeros(num_pad, np.int32)])
            rows = np.concatenate([rows, np.full(num_pad, self.pad_row, np.int32)])
        cu_seqlens_q = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu_seqlens_q[1:])
        num_tokens = int(cu_seqlens_q[-1])
        # token t of request i sits at position context_lens[i] + (t - cu_seqlens_q[i])
        positions = np.arange(num_tokens, dtype=np.int32) - np.repeat(
            cu_seqlens_q[:-1] - context_lens, query_lens)
        token_rows = np.repeat(rows, query_lens)
        token_ids = np.asarray(step.token_ids, dtype=np.int32)
        if num_pad:
            positions = np.concatenate([positions, np.zeros(num_pad, np.int32)])
            token_rows = np.concatenate([token_rows, np.full(num_pad, self.pad_row, np.int32)])
            token_ids = np.concatenate([token_ids, np.zeros(num_pad, np.int32)])
        sample = np.asarray(step.sample, dtype=bool)
        logits_indices = (cu_seqlens_q[1:len(step.rows) + 1] - 1)[sample]
        sample_rows = rows[:len(step.rows)][sample]
        parts = [token_ids, positions, token_rows, cu_seqlens_q, context_lens + query_lens, rows,
                 logits_indices, sample_rows, np.asarray(step.table_rows, np.int32),
                 np.asarray(step.table_cols, np.int32), np.asarray(step.table_blocks, np.int32)]
        device_buf = to_device(np.concatenate(parts), self.device)
        views = torch.split(device_buf, [len(p) for p in parts])
        return _Inputs(*views, max_query_len=int(query_lens.max()),
                       sample_rows_host=sample_rows.tolist())

    # ---- CUDA graphs for decode-only steps ------------------------------------------------
    def _graph_bucket(self, step: StepInput) -> int:
        if not self.graphs or max(step.query_lens) != 1 or not all(step.sample):
            return 0
        return next((b for b in sorted(self.graphs) if b >= len(step.rows)), 0)

    def capture_cuda_graphs(self, max_batch_size: int) -> None:
        """Capture the model's forward for decode batches of each bucket size (largest first,
        sharing one memory pool). Needs the KV cache allocated."""
        if not self.use_cuda_graphs:
            return
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= min(max_batch_size, self.max_num_seqs)]
        largest = max(sizes)
        pad = torch.full((largest,), self.pad_row, dtype=torch.int32, device=self.device)
        self._graph_in = dict(
            input_ids=torch.zeros(largest, dtype=torch.int32, device=self.device),
            positions=torch.zeros(largest, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.zeros(largest + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.zeros(largest, dtype=torch.int32, device=self.device),
            block_tables=self.block_table[pad].clone(),
            slot_mapping=torch.zeros(largest, dtype=torch.int64, device=self.device),
            logits_indices=torch.arange(largest, device=self.device))
        # graphs read these buffers by address: they live as long as the graphs
        self._graph_in["slot_mapping"].fill_(self.block_size * int(self.block_table[self.pad_row, 0]))
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(sizes, reverse=True):
                meta, ids, pos, idx = self._graph_views(size)
                for _ in range(2):  # warm up: compiles the Triton kernels for this shape
                    self.model(ids, pos, self.kv_caches, meta, idx)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model(ids, pos, self.kv_caches, meta, idx)
                self.graphs[size] = _Graph(graph, logits)
        torch.cuda.synchronize()

    def _graph_views(self, size: int):
        g = self._graph_in
        meta = AttentionMetadata(
            cu_seqlens_q=g["cu_seqlens_q"][:size + 1], seq_lens=g["seq_lens"][:size],
            block_tables=g["block_tables"][:size], slot_mapping=g["slot_mapping"][:size],
            block_size=self.block_size, max_query_len=1)
        return meta, g["input_ids"][:size], g["positions"][:size], g["logits_indices"][:size]

    def _replay(self, bucket: int, input_ids, positions, meta: AttentionMetadata):
        g = self._graph_in
        g["input_ids"][:bucket].copy_(input_ids)
        g["positions"][:bucket].copy_(positions)
        g["cu_seqlens_q"][:bucket + 1].copy_(meta.cu_seqlens_q)
        g["seq_lens"][:bucket].copy_(meta.seq_lens)
        g["block_tables"][:bucket].copy_(meta.block_tables)
        g["slot_mapping"][:bucket].copy_(meta.slot_mapping)
        self.graphs[bucket].graph.replay()
        return self.graphs[bucket].logits


class StepTimeline:
    """GPU time spent in steps, and GPU time idle between consecutive steps (waiting on the
    control plane), from CUDA events recorded around each step's work."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._prev_stop: torch.cuda.Event | None = None
        self.busy_ms = self.idle_ms = 0.0
        self.num_steps = 0

    def begin(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def end(self) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self.events.append((self._start, stop))
        if len(self.events) > 64:  # bound memory: fold in what has finished, without waiting
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        while self.events and (wait or self.events[0][1].query()):
            start, stop = self.events.pop(0)
            stop.synchronize()
            self.busy_ms += start.elapsed_time(stop)
            if self._prev_stop is not None:
                self.idle_ms += self._prev_stop.elapsed_time(start)
            self._prev_stop = stop
            self.num_steps += 1

    def collect(self) -> dict:
        """Fold in the steps recorded so far (waits for them to finish)."""
        self._fold(wait=True)
        return {"num_steps": self.num_steps, "gpu_busy_ms": self.busy_ms,
                "gpu_idle_between_steps_ms": self.idle_ms}


@dataclass(slots=True)
class _Inputs:
    input_ids: torch.Tensor  # [T] (placeholders -1)
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] table row of each token's request
    cu_seqlens_q: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B]
    rows: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # [N] the last token of each sampling request
    sample_rows: torch.Tensor  # [N]
    table_rows: torch.Tensor
    table_cols: torch.Tensor
    table_blocks: torch.Tensor
    max_query_len: int
    sample_rows_host: list[int]
