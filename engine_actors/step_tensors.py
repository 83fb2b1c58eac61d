"""A step message as device tensors: flattened tokens with per-request positions (TCB's
padding-free concatenation), the attention metadata, sampling indices, block-table deltas
and LoRA tiles, all sent to the device in one copy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_actors.logits_processors import prompt_positions
from engine_actors.messages import StepInput
from engine_actors.transfer import Staging
from kernels.lora import group_tokens


def prepare(step: StepInput, pad_to: int, pad_row: int, row_lora: np.ndarray | None,
            staging: Staging, lora_tiles: int = 0, pad_tokens_to: int = 0) -> StepTensors:
    """Every integer of the step in one host array and one copy, then device views.
    pad_to: requests after padding (a CUDA graph's bucket); pad_row: the table row of
    padding requests and tokens; row_lora: each table row's adapter slot, when LoRA is on;
    lora_tiles: under a graph, the fixed number of LoRA tiles (and tokens in order);
    pad_tokens_to: tokens after padding (a mixed-step graph's bucket; by default one
    padding token per padding request, as a decode graph has)."""
    query_lens = np.asarray(step.query_lens, dtype=np.int32)
    context_lens = np.asarray(step.context_lens, dtype=np.int32)
    rows = np.asarray(step.rows, dtype=np.int32)
    num_pad = pad_to - len(rows)
    if num_pad:  # graph padding: empty requests whose one token lands in the scratch block
        query_lens = np.concatenate([query_lens, np.zeros(num_pad, np.int32)])
        context_lens = np.concatenate([context_lens, np.zeros(num_pad, np.int32)])
        rows = np.concatenate([rows, np.full(num_pad, pad_row, np.int32)])
    cu_seqlens_q = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    # token t of request i sits at position context_lens[i] + (t - cu_seqlens_q[i])
    positions = np.arange(num_tokens, dtype=np.int32) - np.repeat(
        cu_seqlens_q[:-1] - context_lens, query_lens)
    token_rows = np.repeat(rows, query_lens)
    token_ids = np.asarray(step.token_ids, dtype=np.int32)
    token_pad = pad_tokens_to - num_tokens if pad_tokens_to else num_pad
    if token_pad:  # tokens of no request: they write their keys/values into the scratch block
        positions = np.concatenate([positions, np.zeros(token_pad, np.int32)])
        token_rows = np.concatenate([token_rows, np.full(token_pad, pad_row, np.int32)])
        token_ids = np.concatenate([token_ids, np.zeros(token_pad, np.int32)])
    # each sampling request's last token, or with a draft its last 1 + drafts tokens
    counts = np.asarray(step.sample, dtype=np.int32)
    if step.num_drafts:
        counts *= 1 + np.asarray(step.num_drafts, dtype=np.int32)
    total = int(counts.sum())
    logits_indices = np.repeat(cu_seqlens_q[1:len(step.rows) + 1] - counts, counts) \
        + np.arange(total, dtype=np.int32) - np.repeat(np.cumsum(counts) - counts, counts)
    sample_rows = np.repeat(rows[:len(step.rows)], counts)
    shift_tokens, shift_reqs = spans(cu_seqlens_q, step.shifted), np.asarray(step.shifted, np.int32)
    sizes = counts[counts > 0] if step.num_drafts else np.zeros(0, np.int32)
    group_first = np.cumsum(sizes, dtype=np.int32) - sizes  # each sampling request's first
    sample_group = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    prompt_indices, targets, counts = prompt_positions(step, cu_seqlens_q)
    token_slots, order, tiles = None, np.zeros(0, np.int32), []  # LoRA: tokens by adapter
    if row_lora is not None:
        token_slots = row_lora[token_rows]
        order, tiles = group_tokens(token_slots)
        if lora_tiles:  # a graph's fixed grid: empty tiles last, order padded to its tokens
            tiles += [(0, 0, -1)] * (lora_tiles - len(tiles))
            order = np.concatenate([order, np.zeros(len(token_rows) - len(order), np.int32)])
    parts = [token_ids, positions, token_rows, cu_seqlens_q, context_lens + query_lens, rows,
             np.concatenate([logits_indices, np.asarray(prompt_indices, np.int32)]),
             sample_rows, np.asarray(targets, np.int32),
             np.asarray(step.table_rows, np.int32),
             np.asarray(step.table_cols, np.int32), np.asarray(step.table_blocks, np.int32),
             shift_tokens, shift_reqs, sample_group,
             np.arange(len(sample_group), dtype=np.int32) - np.repeat(group_first, sizes),
             group_first, sizes - 1, order, np.asarray(tiles, np.int32).reshape(-1)]
    # each part starts 16-byte aligned: Triton specializes kernels on the alignment of their
    # pointers, and a new alignment would compile them again in the middle of serving
    padded = [len(p) + -len(p) % 4 for p in parts]
    host = np.zeros(sum(padded), np.int32)
    starts = np.cumsum([0] + padded[:-1])
    for start, part in zip(starts, parts):
        host[start:start + len(part)] = part
    device_buf = staging.to_device(host)
    views = [device_buf[start:start + len(p)] for start, p in zip(starts, parts)]
    return StepTensors(*views[:-1], views[-1].view(-1, 3),
                       max_query_len=int(query_lens.max()),
                       max_samples=int(sizes.max()) if len(sizes) else 1,
                       sample_rows_host=sample_rows.tolist(), prompt_counts=counts,
                       lora_token_slots=token_slots)


def spans(cu_seqlens_q: np.ndarray, requests: list[int]) -> np.ndarray:
    """The flattened token indices of these requests."""
    if not requests:
        return np.zeros(0, np.int32)
    starts, ends = cu_seqlens_q[requests], cu_seqlens_q[np.asarray(requests) + 1]
    lens = ends - starts
    return (np.repeat(starts - (np.cumsum(lens) - lens), lens)
            + np.arange(lens.sum())).astype(np.int32)


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor  # [T] (-1: continue from the last sample)
    positions: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T] table row of each token's request
    cu_seqlens_q: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B]
    rows: torch.Tensor  # [B]
    logits_indices: torch.Tensor  # [N + M] the last token of each sampling request (and its
    #         draft tokens), then the M prompt positions whose log-probabilities are asked
    sample_rows: torch.Tensor  # [N] the table row of each
    prompt_targets: torch.Tensor  # [M] the prompt token after each of those positions
    table_rows: torch.Tensor
    table_cols: torch.Tensor
    table_blocks: torch.Tensor
    # speculative decoding (engine_actors/speculative.py): the tokens and the requests to move
    # back by their rows' rejected draft tokens (StepInput.shifted); each sample's request
    # (among the sampling ones) and its place in it; each such request's first sample and
    # draft length
    shift_tokens: torch.Tensor
    shift_reqs: torch.Tensor
    sample_group: torch.Tensor
    sample_offset: torch.Tensor
    group_first: torch.Tensor
    group_drafts: torch.Tensor
    lora_order: torch.Tensor  # the adapter tokens grouped by slot, see kernels/lora.py
    lora_tiles: torch.Tensor  # [n, 3] (first, end, adapter slot) over lora_order
    max_query_len: int
    max_samples: int  # the most samples of one request (1 + its draft)
    sample_rows_host: list[int]
    prompt_counts: list[int]  # positions per StepInput.prompt_logprobs entry
    lora_token_slots: np.ndarray | None  # host: each token's adapter slot (-1: none)
