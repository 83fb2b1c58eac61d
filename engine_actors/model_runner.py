"""One iteration on one device: step message -> flattened tensors -> model -> sampled ids.

`launch()` only enqueues work: the step's integers go to the device in one pinned,
non-blocking copy, the sampled ids come back in one non-blocking copy, and the returned
`PendingStep` is waited on separately, so the worker can accept and enqueue the next step
while the device still runs this one. Decode-only steps replay a CUDA graph captured for
the smallest batch-size bucket that fits, steps with prompt tokens a mixed-step graph of
the smallest token and request buckets that fit (up to 2048 tokens); other steps (LoRA
adapters or prompt log-probabilities in a mixed step, larger steps) run eagerly.

As a pipeline stage, the runner receives the previous stage's hidden states and residual,
runs its layers and sends them on; only the last stage samples.
"""
from __future__ import annotations

import numpy as np
import torch

from engine_actors.checkpoint import load_hf_config
from engine_actors.cuda_graphs import DecodeGraphs, MixedGraphs
from engine_actors.kv_cache import cdiv
from engine_actors.kv_memory import KVMemory
from engine_actors.grammar import Grammars
from engine_actors.layers import lora as lora_layers
from engine_actors.layers.attention import AttentionMetadata
from engine_actors.logits_processors import ids_only
from engine_actors.messages import StepInput, StepResult
from engine_actors.parallel import SINGLE, ParallelGroup
from engine_actors.plain_config import config_data, plain_config
from engine_actors.pooling import embed, embeddings_result, read_pooling
from engine_actors.model_loader import KV_DTYPES, load_model
from engine_actors.quantization import check_kv_device, read_format
from engine_actors.sampler import Sampler
from engine_actors.sampling_head import SamplingHead
from engine_actors.speculative import shift_positions
from engine_actors.stage_link import StageLink, TokenLink
from engine_actors.step_extras import CONTINUE
from engine_actors.step_tensors import StepTensors, prepare
from engine_actors.timeline import StepTimeline
from engine_actors.transfer import PendingStep, Staging
from kernels.lora import max_tiles

class ModelRunner:
    def __init__(self, model_path: str, device: str, dtype: torch.dtype, max_model_len: int,
                 block_size: int, max_num_seqs: int, seed: int, use_cuda_graphs: bool = True,
                 parallel: ParallelGroup = SINGLE, lora: tuple[int, int] | None = None,
                 pooling: bool = False, quantization: str | None = None,
                 config: dict | None = None, classifier_tokens: list[str] | None = None,
                 kv_cache_dtype: str = "auto"):
        """lora: (slots, max rank) to serve LoRA adapters; None: the base model only.
        pooling: each sampling row's embedding instead of a token (runner "pooling").
        quantization: "fp8" to quantize an unquantized checkpoint's projections as they load
        (an FP8 checkpoint's own format is read from its config either way).
        config: the checkpoint's config as plain data (ModelInfo.config); read from the
        checkpoint if not given. classifier_tokens: a pooling runner scores (pooling.py).
        kv_cache_dtype: "auto" (the model's dtype) or an FP8 format (EngineConfig's)."""
        self.device = torch.device(device)
        self.parallel = parallel
        self.dtype = dtype
        self.kv_dtype = KV_DTYPES.get(kv_cache_dtype, dtype)
        check_kv_device(self.kv_dtype, self.device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.hf_config = plain_config(config or config_data(load_hf_config(model_path)))
        self.fp8 = read_format(self.hf_config, quantization)
        labels = len(self.hf_config.id2label) \
            if hasattr(self.hf_config, "sequence_classifier") else 0
        self.pooling = read_pooling(model_path, classifier_tokens, labels) if pooling else None
        self.model = load_model(model_path, self.hf_config, self.dtype, self.device,
                                max_model_len, parallel, self.fp8, self.pooling)
        self.row_lora = None  # host: each table row's adapter slot (-1: the base model)
        self.lora_slots = lora[0] if lora is not None else 0
        if lora is not None:
            lora_layers.attach(self.model, *lora, dtype)
            self.row_lora = np.full(max_num_seqs + 1, -1, dtype=np.int32)
        attn = next(iter(self.model.layers.values())).self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim  # on this rank
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_memory: KVMemory | None = None  # the pool's memory (blocks lent to training)
        # Row r holds the block ids of the request admitted at row r, in position order.
        # The extra last row is the padding row of CUDA-graph batches: every entry points
        # at a scratch block, so padding tokens write their keys/values there.
        self.pad_row = max_num_seqs
        self.block_table = torch.zeros(max_num_seqs + 1, cdiv(max_model_len, block_size),
                                       dtype=torch.int32, device=self.device)
        self.last_sampled = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self.shift = torch.zeros_like(self.last_sampled)  # speculative.accept_on_device's
        self.staging = Staging(self.device)
        self.head = SamplingHead(Sampler(max_num_seqs, self.device, seed, self.staging),
                                 Grammars(model_path, self.hf_config.vocab_size), self.staging)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda" and not pooling
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        self.num_graph_replays = self.num_mixed_replays = 0
        self.timeline = StepTimeline() if self.device.type == "cuda" else None
        self.link: StageLink | None = None
        self.tokens: TokenLink | None = None
        self.fail_next = False  # chaos testing: the next forward raises

    def allocate_stage_buffers(self, max_tokens: int, num_in_flight: int,
                               continuation: bool = False) -> None:
        """The pipeline link to the neighbouring stages (see StageLink); with continuation
        (async scheduling), the link of sampled ids from the last stage to the first."""
        if self.parallel.pp_size > 1:
            self.link = StageLink(self.parallel, max_tokens, self.hf_config.hidden_size, self.dtype,
                                  self.device, num_in_flight)
            # (a pooling step samples no token: nothing goes back)
            if continuation and self.pooling is None and (self.parallel.is_first_stage
                                                          or self.parallel.is_last_stage):
                self.tokens = TokenLink(self.parallel, self.last_sampled, self.max_num_seqs)

    # ---- KV cache -----------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * len(self.model.layers) * self.block_size * self.num_kv_heads \
            * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, lendable: bool = True) -> None:
        """num_blocks usable blocks plus one scratch block (id num_blocks) for padding;
        `lendable`: fine-tuning may borrow the memory of free blocks."""
        if self.kv_memory is not None:
            self.kv_memory.free()
        shape = ((num_blocks + 1) * self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_memory = KVMemory(len(self.model.layers), shape, self.block_size, self.kv_dtype,
                                  self.device, lendable)
        self.kv_caches = self.kv_memory.tensors
        self.block_table[self.pad_row] = num_blocks
        self.graphs = self.mixed = None

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, step: StepInput) -> PendingStep:
        """Enqueue one iteration. On the last stage the PendingStep yields one token per row
        with sample=True; on other stages it only marks the step's end."""
        if self.timeline is not None:
            self.timeline.begin()
        logits, inputs = self.forward(step)
        out, parse = None, None
        if logits is not None and self.pooling is not None:  # (final hidden states)
            out, parse = embed(logits, self.pooling), embeddings_result
        elif logits is not None:
            out, parse = self.head.sample(logits, inputs, step, self.last_sampled, self.shift)
            if self.tokens is not None and inputs.sample_rows_host:
                self.tokens.send(self.last_sampled[inputs.sample_rows])
        pending = self.staging.to_host(out, parse or ids_only, raw=parse is embeddings_result)
        self.head.launched(pending)
        if self.timeline is not None:
            self.timeline.end()
        return pending

    def execute(self, step: StepInput) -> StepResult:
        return self.launch(step).result()

    @torch.inference_mode()
    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, StepTensors]:
        """Apply the step's table deltas and run this stage: fp32 logits [N, V] of the N
        sampling requests on the last stage, None elsewhere (hidden states are sent on)."""
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("fault injected into the forward pass")
        self.head.add(step.new_requests, self.parallel.is_last_stage)
        if self.row_lora is not None:
            for slot, weights, scale in step.lora_loads:
                lora_layers.load_adapter(self.model, slot, weights, scale)
            for r in step.new_requests:
                self.row_lora[r.row] = r.lora_slot
        num_reqs, num_tokens = len(step.rows), len(step.token_ids)
        bucket = self.graphs.bucket_for(num_reqs) if self._is_graphable(step) else 0
        mixed = None if bucket else self._mixed_bucket(step)
        inputs = prepare(step, bucket or (mixed[1] if mixed else num_reqs), self.pad_row,
                         self.row_lora, self.staging,
                         max_tiles(bucket, self.lora_slots) if bucket and self.lora_slots else 0,
                         pad_tokens_to=mixed[0] if mixed else 0)
        if inputs.table_rows.numel():
            self.block_table[inputs.table_rows, inputs.table_cols] = inputs.table_blocks
        if step.shifted:
            shift_positions(inputs, self.shift)
        input_ids = hidden = residual = None
        if self.parallel.is_first_stage:
            if self.tokens is not None and CONTINUE in step.token_ids:
                # the rows' previous steps are at least P back (Scheduler.stride)
                self.tokens.wait_through(step.step_id - self.parallel.pp_size)
            # -1 (CONTINUE): the token this row's previous step sampled, still on the device
            input_ids = self._resolve(inputs)
        else:
            hidden, residual = self.link.recv(step.step_id, num_tokens)
        meta = AttentionMetadata(
            cu_seqlens_q=inputs.cu_seqlens_q, seq_lens=inputs.seq_lens,
            block_tables=self.block_table[inputs.rows],
            slot_mapping=self._slot_mapping(inputs.token_rows, inputs.positions),
            block_size=self.block_size, max_query_len=inputs.max_query_len)
        if self.parallel.is_last_stage and self.head.sampler.processors.counted:
            # penalties count the step's tokens (the last stage sampled any -1 itself)
            resolved = input_ids if input_ids is not None else self._resolve(inputs)
            self.head.sampler.processors.observe(step.rows, inputs.token_rows, inputs.positions,
                                            resolved, self.hf_config.vocab_size)
        if bucket:
            self.num_graph_replays += 1
            lora = inputs.lora_token_slots is not None and (inputs.lora_token_slots >= 0).any()
            out = self.graphs.replay(bucket, input_ids, inputs.positions, meta, hidden, residual,
                                     *((inputs.lora_order, inputs.lora_tiles) if lora else ()))
        elif mixed:
            self.num_mixed_replays += 1
            out = self.mixed.replay(mixed, input_ids, inputs.positions, meta,
                                    inputs.logits_indices, hidden, residual)
        else:
            if self.row_lora is not None:
                lora_layers.set_batch(lora_layers.LoRABatch(
                    inputs.lora_order, inputs.lora_tiles, inputs.lora_token_slots))
            out = self.model(input_ids, inputs.positions, self.kv_caches, meta,
                             inputs.logits_indices, hidden, residual,
                             head=self.pooling is None)
        if not self.parallel.is_first_stage:
            self.link.release_recv(step.step_id)
        if not self.parallel.is_last_stage:
            self.link.send(step.step_id, out[0][:num_tokens], out[1][:num_tokens])
            if self.tokens is not None and inputs.sample_rows_host:
                self.tokens.post(step.step_id, inputs.sample_rows)
            return None, inputs
        return (out[:num_reqs] if bucket else out), inputs  # graphs pad the batch

    def _resolve(self, inputs: StepTensors) -> torch.Tensor:
        return torch.where(inputs.input_ids >= 0, inputs.input_ids,
                           self.last_sampled[inputs.token_rows])

    def _is_graphable(self, step: StepInput) -> bool:
        return self.graphs is not None and max(step.query_lens) == 1 and all(step.sample) \
            and not step.prompt_logprobs

    def _mixed_bucket(self, step: StepInput) -> tuple[int, int] | None:
        """The mixed-step graph that fits the step, if any (none with prompt log-probabilities
        or LoRA adapters)."""
        if self.mixed is None or step.prompt_logprobs or (
                self.row_lora is not None and (self.row_lora[step.rows] >= 0).any()):
            return None
        # (a graph's logits rows are its request bucket: drafts sample several per request)
        return self.mixed.bucket_for(len(step.token_ids), len(step.rows) + sum(step.num_drafts))

    def _slot_mapping(self, token_rows, positions):
        blocks = self.block_table[token_rows, positions // self.block_size]
        return blocks.long() * self.block_size + positions % self.block_size

    # ---- CUDA graphs ----------------------------------------------------------------------
    def capture_cuda_graphs(self, max_batch_size: int, max_step_tokens: int = 0,
                            samples_per_request: int = 1) -> None:
        """Capture decode graphs for every bucket up to max_batch_size, and mixed-step graphs
        for token buckets up to max_step_tokens (0: none), with logits rows for up to
        samples_per_request per request (1 + speculative drafts); needs the KV cache."""
        if not self.use_cuda_graphs:
            return
        pool, pad, max_reqs = torch.cuda.graph_pool_handle(), self.block_table[self.pad_row], \
            min(max_batch_size, self.max_num_seqs)
        # the larger graphs first: the decode graphs reuse their pool. One worker only: with
        # several, the mixed steps' collectives inside graphs have not been run on GPUs yet.
        if max_step_tokens and self.parallel.tp_size == self.parallel.pp_size == 1:
            mixed = MixedGraphs(self.model, self.kv_caches, pad, self.block_size,
                                min(max_step_tokens, self.max_model_len),
                                max_reqs * samples_per_request, self.dtype)
            mixed.capture(pool)
            self.mixed = mixed if mixed.graphs else None
        self.graphs = DecodeGraphs(self.model, self.kv_caches, pad, self.block_size, max_reqs,
                                   self.dtype, lora_slots=self.lora_slots)
        self.graphs.capture(pool)
