"""CUDA graphs of one stage's forward: decode-only steps (one graph per batch-size bucket)
and mixed steps (prompts beside decodes, one graph per token and request bucket).

A step of B decode requests replays the graph of the smallest bucket >= B: the step's inputs
are copied into static buffers, padding requests have no query tokens (attention skips them)
and write their one key/value into a scratch block. Graphs share one memory pool and read
their buffers by address, so the buffers live as long as the graphs. With LoRA slots each
bucket has two graphs: one with the LoRA kernels, replayed when some request of the step has
an adapter, and one without, so that base-model steps cost nothing more.
"""
from __future__ import annotations

import torch

from engine_actors.layers import lora as lora_layers
from engine_actors.layers.attention import AttentionMetadata
from kernels.attention import tile_shape, work_list
from kernels.split_kv import decode_splits
from kernels.lora import max_tiles

BATCH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


class DecodeGraphs:
    def __init__(self, model, kv_caches, pad_block_table_row: torch.Tensor, block_size: int,
                 max_batch_size: int, dtype: torch.dtype, lora_slots: int = 0):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.first, self.last = model.parallel.is_first_stage, model.parallel.is_last_stage
        self.sizes = [b for b in BATCH_SIZES if b <= max_batch_size]
        n, dev = max(self.sizes), pad_block_table_row.device
        hidden = model.config.hidden_size
        self.buf = dict(
            input_ids=torch.zeros(n, dtype=torch.int32, device=dev),
            positions=torch.zeros(n, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.zeros(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            block_tables=pad_block_table_row.expand(n, -1).clone(),
            # padding tokens write their keys/values into the scratch block
            slot_mapping=torch.full((n,), int(pad_block_table_row[0]) * block_size,
                                    dtype=torch.int64, device=dev),
            logits_indices=torch.arange(n, device=dev),
            hidden=torch.zeros(n, hidden, dtype=dtype, device=dev),
            residual=torch.zeros(n, hidden, dtype=dtype, device=dev),
            # LoRA (kernels/lora.py): tokens grouped by slot, tiles (first, end, slot)
            lora_order=torch.zeros(n, dtype=torch.int32, device=dev),
            lora_tiles=torch.tensor([[0, 0, -1]] * max_tiles(n, lora_slots), dtype=torch.int32,
                                    device=dev))
        self.lora_slots = lora_slots
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, object]] = {}

    def bucket_for(self, num_reqs: int) -> int:
        return next((b for b in self.sizes if b >= num_reqs and (b, False) in self.graphs), 0)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Largest first, so smaller graphs reuse the pool. Collective: with tensor
        parallelism every rank of the stage captures the same buckets in the same order."""
        for size in sorted(self.sizes, reverse=True):
            args = self._args(size)
            for lora in [False, True] if self.lora_slots else [False]:
                # the LoRA kernels read these buffers
                lora_layers.set_batch(lora_layers.LoRABatch(
                    self.buf["lora_order"][:size],
                    self.buf["lora_tiles"][:max_tiles(size, self.lora_slots)], None)
                    if lora else None)
                for _ in range(2):  # warm up: compiles the Triton kernels for this shape
                    self.model(*args)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                self.graphs[size, lora] = (graph, out)
        lora_layers.set_batch(None)
        torch.cuda.synchronize()

    def replay(self, bucket: int, input_ids, positions, meta: AttentionMetadata, hidden=None,
               residual=None, lora_order=None, lora_tiles=None):
        """Outputs of the first `bucket` rows: logits, or (hidden, residual) mid-pipeline.
        lora_order/lora_tiles: the step's LoRA tokens, None when no request has an adapter."""
        b = self.buf
        n = positions.shape[0]  # real tokens; the rest of the bucket keeps padding values
        if self.first:
            b["input_ids"][:n].copy_(input_ids)
        else:
            b["hidden"][:hidden.shape[0]].copy_(hidden)
            b["residual"][:residual.shape[0]].copy_(residual)
        b["positions"][:n].copy_(positions)
        b["cu_seqlens_q"][:bucket + 1].copy_(meta.cu_seqlens_q)
        b["seq_lens"][:bucket].copy_(meta.seq_lens)
        b["block_tables"][:bucket].copy_(meta.block_tables)
        b["slot_mapping"][:bucket].copy_(meta.slot_mapping)
        lora = lora_tiles is not None
        if lora:
            b["lora_order"][:bucket].copy_(lora_order)
            b["lora_tiles"][:lora_tiles.shape[0]].copy_(lora_tiles)
        graph, out = self.graphs[bucket, lora]
        graph.replay()
        return out

    def _args(self, size: int):
        b = self.buf
        meta = AttentionMetadata(
            cu_seqlens_q=b["cu_seqlens_q"][:size + 1], seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size], slot_mapping=b["slot_mapping"][:size],
            block_size=self.block_size, max_query_len=1)
        hidden, residual = (None, None) if self.first else (b["hidden"][:size],
                                                             b["residual"][:size])
        return (b["input_ids"][:size], b["positions"][:size], self.kv_caches, meta,
                b["logits_indices"][:size], hidden, residual)


# (the small ones serve steps of a few tokens per request: speculative drafts, short prompts)
TOKEN_SIZES = [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
REQUEST_SIZES = [8, 32, 128, 256]


def token_buckets(max_tokens: int) -> list[int]:
    """The mixed-step graphs' token buckets for steps of up to max_tokens tokens: those
    below it, then max_tokens itself (steps past 2048 tokens run eagerly)."""
    below = [t for t in TOKEN_SIZES if t < max_tokens]
    return below + ([max_tokens] if max_tokens <= TOKEN_SIZES[-1] else [])


class MixedGraphs:
    """CUDA graphs of steps that carry prompt tokens: a step of T tokens in B requests
    replays the graph of the smallest token bucket >= T and request bucket >= B. Padding
    tokens belong to no request and write into the scratch block; padding requests have no
    tokens. Attention takes its launch grid from a work list built on the device
    (kernels.attention.work_list), sized for the bucket. A graph stops at the final hidden
    states of the sampling tokens: the LM head runs after it, so that graphs keep [B, H]
    outputs rather than [B, vocab] logits alive. Steps with LoRA adapters or prompt
    log-probabilities, and steps past the largest bucket, run eagerly."""

    def __init__(self, model, kv_caches, pad_block_table_row: torch.Tensor, block_size: int,
                 max_tokens: int, max_requests: int, dtype: torch.dtype):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.first, self.last = model.parallel.is_first_stage, model.parallel.is_last_stage
        self.token_sizes = token_buckets(max_tokens)
        self.request_sizes = sorted({min(r, max_requests) for r in REQUEST_SIZES}
                                    | {max_requests})
        attn = next(iter(model.layers.values())).self_attn
        # query tokens per attention tile at prefill (the kernel's BLOCK_M)
        self.block_m = tile_shape(attn.num_heads, attn.num_kv_heads, attn.head_dim, 2)[0]
        self.num_kv_heads = attn.num_kv_heads
        t, r, dev = max(self.token_sizes, default=0), max(self.request_sizes), \
            pad_block_table_row.device
        hidden = model.config.hidden_size
        self.buf = dict(
            input_ids=torch.zeros(t, dtype=torch.int32, device=dev),
            positions=torch.zeros(t, dtype=torch.int32, device=dev),
            slot_mapping=torch.zeros(t, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.zeros(r + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(r, dtype=torch.int32, device=dev),
            block_tables=pad_block_table_row.expand(r, -1).clone(),
            logits_indices=torch.zeros(r, dtype=torch.int64, device=dev),
            hidden=torch.zeros(t, hidden, dtype=dtype, device=dev),
            residual=torch.zeros(t, hidden, dtype=dtype, device=dev))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object]] = {}

    def bucket_for(self, num_tokens: int, num_reqs: int) -> tuple[int, int] | None:
        """The smallest graph that holds the step (a token bucket has no request bucket
        above its tokens: the next token bucket may)."""
        return next(((t, r) for t in self.token_sizes if t >= num_tokens
                     for r in self.request_sizes if r >= num_reqs and (t, r) in self.graphs),
                    None)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Largest first, into the decode graphs' pool. Collective like DecodeGraphs.capture.
        Without the LoRA kernels: steps with adapter tokens run eagerly."""
        lora_layers.set_batch(None)  # an earlier eager step's batch must not be captured
        for t in sorted(self.token_sizes, reverse=True):
            for r in sorted(self.request_sizes, reverse=True):
                if r > t:
                    continue
                args = self._args(t, r)
                for _ in range(2):  # warm up: compiles the Triton kernels for this shape
                    self._run(t, r, args)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._run(t, r, args)
                self.graphs[t, r] = (graph, out)
        torch.cuda.synchronize()

    def replay(self, bucket: tuple[int, int], input_ids, positions, meta: AttentionMetadata,
               logits_indices, hidden=None, residual=None):
        """fp32 logits [N, V] of the N tokens in logits_indices (the LM head runs after the
        graph), or (hidden, residual) [bucket tokens, H] mid-pipeline. The step's tensors are
        padded to the bucket (step_tensors.prepare)."""
        b = self.buf
        t, r = bucket
        if self.first:
            b["input_ids"][:t].copy_(input_ids)
        else:
            b["hidden"][:hidden.shape[0]].copy_(hidden)
            b["residual"][:residual.shape[0]].copy_(residual)
        b["positions"][:t].copy_(positions)
        b["slot_mapping"][:t].copy_(meta.slot_mapping)
        b["cu_seqlens_q"][:r + 1].copy_(meta.cu_seqlens_q)
        b["seq_lens"][:r].copy_(meta.seq_lens)
        b["block_tables"][:r].copy_(meta.block_tables)
        n = logits_indices.shape[0]
        b["logits_indices"][:n].copy_(logits_indices)
        b["logits_indices"][n:r].zero_()  # stale indices may lie past this bucket's tokens
        graph, out = self.graphs[bucket]
        graph.replay()
        return self.model.logits(out[:n]) if self.last else out

    def _args(self, t: int, r: int):
        b = self.buf
        meta = AttentionMetadata(
            cu_seqlens_q=b["cu_seqlens_q"][:r + 1], seq_lens=b["seq_lens"][:r],
            block_tables=b["block_tables"][:r], slot_mapping=b["slot_mapping"][:t],
            block_size=self.block_size, max_query_len=t)
        hidden, residual = (None, None) if self.first else (b["hidden"][:t], b["residual"][:t])
        return (b["input_ids"][:t], b["positions"][:t], self.kv_caches, meta,
                b["logits_indices"][:r], hidden, residual)

    def _run(self, t: int, r: int, args):
        meta = args[3]
        # decode rows beside the prompts split their keys as a decode step of r rows would;
        # at most one partial tile (or `splits` chunks) per request beyond the full tiles
        meta.splits = decode_splits(r, self.num_kv_heads, meta.cu_seqlens_q.device)
        meta.work = work_list(meta.cu_seqlens_q, self.block_m,
                              -(-t // self.block_m) + r * meta.splits, meta.splits)
        return self.model(*args, head=False)
