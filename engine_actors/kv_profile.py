"""How many KV blocks fit on a GPU: the memory left beside the weights, once the largest
eager step's activations and the CUDA graphs' pool are set aside, both measured by running
such steps on the model runner (engine_actors/model_runner.py)."""
from __future__ import annotations

import torch

from engine_actors.cuda_graphs import token_buckets
from engine_actors.kv_cache import cdiv
from engine_actors.messages import NewRequest, StepInput


def profile_kv_blocks(runner, cfg, graph_batch: int) -> int:
    """KV blocks that fit in cfg.gpu_memory_utilization of the GPU beside the weights, the
    activations of the largest eager step, and the CUDA graphs' memory pool (bounded by
    one eager decode step of graph_batch requests, or one eager step of the largest
    mixed-step graph's tokens; graph_batch 0: no graphs).

    The largest eager step is max_num_batched_tokens tokens of max_batch_size requests that
    all sample, with top-p and as many log-probabilities as max_logprobs allows (at least
    20; -1: the vocabulary), each also at its speculative draft tokens: the logits and
    sampling buffers of the last stage count as much as the layers' activations. A step that needs more than the
    profile saw makes the allocator free its cache, which waits for the device: the host
    stops running ahead of the GPU (with pipeline stages, the stages take turns)."""
    free, total = torch.cuda.mem_get_info()
    used = total - free  # weights, the CUDA context and anything else on the GPU
    step_tokens = min(cfg.max_num_batched_tokens, runner.max_model_len)
    num_reqs = max(1, min(cfg.max_batch_size, runner.max_num_seqs, step_tokens))
    vocab = runner.hf_config.vocab_size
    logprobs = vocab if cfg.max_logprobs == -1 else min(max(cfg.max_logprobs, 20), vocab)
    drafts = max(0, min(cfg.max_drafts, step_tokens // num_reqs - 1))
    activations = _profile_peak_bytes(runner, step_tokens // num_reqs, num_reqs, logprobs,
                                      drafts)
    graphs = _profile_peak_bytes(runner, 1, graph_batch) if graph_batch else 0
    if graph_batch and runner.parallel.tp_size == runner.parallel.pp_size == 1:
        graphs = max(graphs, _profile_peak_bytes(runner, max(token_buckets(step_tokens)), 1))
    budget = total * cfg.gpu_memory_utilization - used - activations - graphs
    blocks = int(budget // runner.kv_bytes_per_block())
    if blocks < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} "
                           "GiB); raise gpu_memory_utilization or use a smaller model")
    return blocks


def _profile_peak_bytes(runner, tokens_per_request: int, num_requests: int,
                        logprobs: int | None = None, drafts: int = 0) -> int:
    """Peak memory of one eager step of num_requests prompts of tokens_per_request (with
    `logprobs`: the costliest sampling settings with that many alternatives; else greedy),
    each sampling at its last 1 + `drafts` tokens."""
    blocks_each = cdiv(tokens_per_request, runner.block_size)
    runner.allocate_kv_cache(blocks_each * num_requests, lendable=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    rows = list(range(num_requests))
    new = [NewRequest(r, temperature=1.0, top_p=0.9, top_k=0, seed=None, logprobs=logprobs)
           for r in rows] if logprobs is not None else []
    step = StepInput(new_requests=new, rows=rows, context_lens=[0] * num_requests,
                     query_lens=[tokens_per_request] * num_requests,
                     sample=[True] * num_requests,
                     num_drafts=[drafts] * num_requests if drafts else [],
                     token_ids=[0] * (tokens_per_request * num_requests),
                     table_rows=[r for r in rows for _ in range(blocks_each)],
                     table_cols=list(range(blocks_each)) * num_requests,
                     table_blocks=list(range(blocks_each * num_requests)))
    runner.execute(step)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    runner.kv_caches, runner.kv_memory = [], None
    torch.cuda.empty_cache()
    return peak
