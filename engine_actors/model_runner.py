"""One iteration on one device: step message -> flattened tensors -> model -> sampled ids.

`launch()` only enqueues work: the step's integers go to the device in one pinned,
non-blocking copy, the sampled ids come back in one non-blocking copy, and the returned
`PendingStep` is waited on separately, so the worker can accept and enqueue the next step
while the device still runs this one. Decode-only steps replay a CUDA graph captured for
the smallest batch-size bucket that fits; other steps run eagerly.

As a pipeline stage, the runner receives the previous stage's hidden states and residual,
runs its layers and sends them on; only the last stage samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_actors.checkpoint import architecture, iter_checkpoint_tensors, load_hf_config
from engine_actors.cuda_graphs import DecodeGraphs
from engine_actors.kv_cache import cdiv
from engine_actors.grammar import Grammars
from engine_actors.layers.attention import AttentionMetadata
from engine_actors.logits_processors import ids_only, prompt_positions
from engine_actors.messages import StepInput, StepResult
from engine_actors.models import model_class
from engine_actors.models.llama import LlamaForCausalLM
from engine_actors.parallel import SINGLE, ParallelGroup
from engine_actors.sampler import Sampler
from engine_actors.sampling_head import SamplingHead
from engine_actors.stage_link import StageLink
from engine_actors.timeline import StepTimeline
from engine_actors.transfer import PendingStep, Staging

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return DTYPES[dtype]


class ModelRunner:
    def __init__(self, model_path: str, device: str, dtype: torch.dtype, max_model_len: int,
                 block_size: int, max_num_seqs: int, seed: int, use_cuda_graphs: bool = True,
                 parallel: ParallelGroup = SINGLE):
        self.device = torch.device(device)
        self.parallel = parallel
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.hf_config = load_hf_config(model_path)
        self.model = self._load_model(model_path)
        attn = next(iter(self.model.layers.values())).self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim  # on this rank
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Row r holds the block ids of the request admitted at row r, in position order.
        # The extra last row is the padding row of CUDA-graph batches: every entry points
        # at a scratch block, so padding tokens write their keys/values there.
        self.pad_row = max_num_seqs
        self.block_table = torch.zeros(max_num_seqs + 1, cdiv(max_model_len, block_size),
                                       dtype=torch.int32, device=self.device)
        self.last_sampled = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.staging = Staging(self.device)
        self.head = SamplingHead(Sampler(max_num_seqs, self.device, seed, self.staging),
                                 Grammars(model_path, self.hf_config.vocab_size), self.staging)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.graphs: DecodeGraphs | None = None
        self.num_graph_replays = 0
        self.timeline = StepTimeline() if self.device.type == "cuda" else None
        self.link: StageLink | None = None
        self.fail_next = False  # chaos testing: the next forward raises

    def allocate_stage_buffers(self, max_tokens: int, num_in_flight: int) -> None:
        """The pipeline link to the neighbouring stages (see StageLink)."""
        if self.parallel.pp_size > 1:
            self.link = StageLink(self.parallel, max_tokens, self.hf_config.hidden_size, self.dtype,
                                  self.device, num_in_flight)

    def _load_model(self, path: str) -> LlamaForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(architecture(self.hf_config))(
                    self.hf_config, self.max_model_len, self.parallel)
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
        return 2 * len(self.model.layers) * self.block_size * self.num_kv_heads \
            * self.head_dim * elem

    def profile_kv_blocks(self, memory_fraction: float, max_step_tokens: int,
                          graph_batch: int) -> int:
        """KV blocks that fit in `memory_fraction` of the GPU beside the weights, the
        activations of the largest eager step, and the decode graphs' memory pool (bounded
        by one eager decode step of graph_batch requests; 0: no graphs)."""
        free, total = torch.cuda.mem_get_info()
        used = total - free  # weights, the CUDA context and anything else on the GPU
        activations = self._profile_peak_bytes(min(max_step_tokens, self.max_model_len), 1)
        graphs = self._profile_peak_bytes(1, graph_batch) if graph_batch else 0
        budget = total * memory_fraction - used - activations - graphs
        blocks = int(budget // self.kv_bytes_per_block())
        if blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} "
                               "GiB); raise gpu_memory_utilization or use a smaller model")
        return blocks

    def _profile_peak_bytes(self, tokens_per_request: int, num_requests: int) -> int:
        """Peak memory of one eager step of num_requests prompts of tokens_per_request."""
        blocks_each = cdiv(tokens_per_request, self.block_size)
        self.allocate_kv_cache(blocks_each * num_requests)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        rows = list(range(num_requests))
        step = StepInput(rows=rows, context_lens=[0] * num_requests,
                         query_lens=[tokens_per_request] * num_requests,
                         sample=[True] * num_requests,
                         token_ids=[0] * (tokens_per_request * num_requests),
                         table_rows=[r for r in rows for _ in range(blocks_each)],
                         table_cols=list(range(blocks_each)) * num_requests,
                         table_blocks=list(range(blocks_each * num_requests)))
        self.execute(step)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks usable blocks plus one scratch block (id num_blocks) for padding."""
        shape = ((num_blocks + 1) * self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(len(self.model.layers))]
        self.block_table[self.pad_row] = num_blocks
        self.graphs = None

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """Enqueue one iteration. On the last stage the PendingStep yields one token per row
        with sample=True; on other stages it only marks the step's end."""
        if self.timeline is not None:
            self.timeline.begin()
        logits, inputs = self.forward(step)
        out, parse = None, None
        if logits is not None:
            out, parse = self.head.sample(logits, inputs, step, self.last_sampled)
        pending = self.staging.to_host(out, parse or ids_only)
        self.head.launched(pending)
        if self.timeline is not None:
            self.timeline.end()
        return pending

    def execute(self, step: StepInput) -> StepResult:
        return self.launch(step).result()

    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, _Inputs]:
        """Apply the step's table deltas and run this stage: fp32 logits [N, V] of the N
        sampling requests on the last stage, None elsewhere (hidden states are sent on)."""
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("fault injected into the forward pass")
        self.head.add(step.new_requests, self.parallel.is_last_stage)
        num_reqs, num_tokens = len(step.rows), len(step.token_ids)
        bucket = self.graphs.bucket_for(num_reqs) if self._is_graphable(step) else 0
        inputs = self._prepare(step, pad_to=bucket or num_reqs)
        if inputs.table_rows.numel():
            self.block_table[inputs.table_rows, inputs.table_cols] = inputs.table_blocks
        input_ids = hidden = residual = None
        if self.parallel.is_first_stage:
            # -1 (CONTINUE): the token this row's previous step sampled, still on the device
            input_ids = torch.where(inputs.input_ids >= 0, inputs.input_ids,
                                    self.last_sampled[inputs.token_rows])
        else:
            hidden, residual = self.link.recv(step.step_id, num_tokens)
        meta = AttentionMetadata(
            cu_seqlens_q=inputs.cu_seqlens_q, seq_lens=inputs.seq_lens,
            block_tables=self.block_table[inputs.rows],
            slot_mapping=self._slot_mapping(inputs.token_rows, inputs.positions),
            block_size=self.block_size, max_query_len=inputs.max_query_len)
        if self.parallel.is_last_stage and self.head.sampler.processors.counted:
            # penalties count the step's tokens (pipelined stages have no -1 continuations)
            resolved = input_ids if input_ids is not None else inputs.input_ids
            self.head.sampler.processors.observe(step.rows, inputs.token_rows, inputs.positions,
                                            resolved, self.hf_config.vocab_size)
        if bucket:
            self.num_graph_replays += 1
            out = self.graphs.replay(bucket, input_ids, inputs.positions, meta, hidden, residual)
        else:
            out = self.model(input_ids, inputs.positions, self.kv_caches, meta,
                             inputs.logits_indices, hidden, residual)
        if not self.parallel.is_first_stage:
            self.link.release_recv(step.step_id)
        if not self.parallel.is_last_stage:
            self.link.send(step.step_id, out[0][:num_tokens], out[1][:num_tokens])
            return None, inputs
        return (out[:num_reqs] if bucket else out), inputs  # graphs pad the batch

    def _is_graphable(self, step: StepInput) -> bool:
        return self.graphs is not None and max(step.query_lens) == 1 and all(step.sample) \
            and not step.prompt_logprobs

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
        prompt_indices, targets, counts = prompt_positions(step, cu_seqlens_q)
        parts = [token_ids, positions, token_rows, cu_seqlens_q, context_lens + query_lens, rows,
                 np.concatenate([logits_indices, np.asarray(prompt_indices, np.int32)]),
                 sample_rows, np.asarray(targets, np.int32),
                 np.asarray(step.table_rows, np.int32),
                 np.asarray(step.table_cols, np.int32), np.asarray(step.table_blocks, np.int32)]
        device_buf = self.staging.to_device(np.concatenate(parts))
        views = torch.split(device_buf, [len(p) for p in parts])
        return _Inputs(*views, max_query_len=int(query_lens.max()),
                       sample_rows_host=sample_rows.tolist(), prompt_counts=counts)

    # ---- CUDA graphs for decode-only steps ------------------------------------------------
    def capture_cuda_graphs(self, max_batch_size: int) -> None:
        """Capture decode graphs for every bucket up to max_batch_size (needs the KV cache)."""
        if not self.use_cuda_graphs:
            return
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_table[self.pad_row],
                              self.block_size, min(max_batch_size, self.max_num_seqs), self.dtype)
        graphs.capture()
        self.graphs = graphs


@dataclass(slots=True)
class _Inputs:
    input_ids: torch.Tensor  # [T] (-1: continue from the last sample)
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] table row of each token's request
    cu_seqlens_q: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B]
    rows: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # [N + M] the last token of each sampling request, then
    #                               the M prompt positions whose log-probabilities are asked
    sample_rows: torch.Tensor  # [N]
    prompt_targets: torch.Tensor  # [M] the prompt token after each of those positions
    table_rows: torch.Tensor
    table_cols: torch.Tensor
    table_blocks: torch.Tensor
    max_query_len: int
    sample_rows_host: list[int]
    prompt_counts: list[int]  # positions per StepInput.prompt_logprobs entry
