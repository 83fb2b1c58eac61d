"""Greedy outputs of the engine equal transformers' generate() token for token (fp32)."""
from __future__ import annotations

import random

import pytest

from engine_actors.checkpoint import resolve_model_path, save_random_llama
from engine_actors.config import DEFAULT_MODEL
from engine_actors.request import SamplingParams
from tests.engine_harness import InProcessEngine, hf_greedy

CHECKPOINTS = {
    # GQA, untied head
    "gqa": dict(),
    # MHA, tied embeddings, head_dim != hidden/heads, q/k/v/o biases, llama3 rope scaling
    "variant": dict(num_key_value_heads=4, tie_word_embeddings=True, head_dim=32,
                    attention_bias=True,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256}),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_random_llama(str(path), seed=3, **CHECKPOINTS[request.param])
    return str(path)


def ragged_workload(seed: int, num_requests: int = 18):
    """Requests with ragged prompts and lengths, arriving over the first iterations."""
    rng = random.Random(seed)
    arrivals = {}
    for i in range(num_requests):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        sampling = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0,
                                  ignore_eos=True)
        arrivals.setdefault(rng.randint(0, 25), []).append((f"r{i}", prompt, sampling))
    return arrivals


def check_parity(model: str, engine: InProcessEngine, arrivals, device="cpu"):
    outputs = engine.run(arrivals)
    requests = [r for reqs in arrivals.values() for r in reqs]
    assert len(requests) >= 16
    for rid, prompt, sampling in requests:
        assert outputs[rid] == hf_greedy(model, prompt, sampling.max_tokens, device), rid
    mixed = [s for s in engine.steps if 1 in s.query_lens and max(s.query_lens) > 1]
    assert mixed, "no iteration mixed prefill and decode"
    ends = {len(outputs[rid]) for rid, _, _ in requests}
    assert len(ends) > 3, "requests should finish at different lengths"


@pytest.mark.parametrize("block_size,budget,overlap", [(16, 4096, True), (1, 4096, True),
                                                       (4, 24, True), (16, 4096, False)])
def test_greedy_matches_transformers(checkpoint, block_size, budget, overlap):
    engine = InProcessEngine(model=checkpoint, max_batch_size=8, block_size=block_size,
                             max_num_batched_tokens=budget, max_num_tokens=4096,
                             async_scheduling=overlap)
    check_parity(checkpoint, engine, ragged_workload(seed=block_size))
    continued = any(-1 in s.token_ids for s in engine.steps)
    assert continued == overlap  # overlapped steps continue from the worker's samples
    if budget < 60:
        assert any(q == budget for s in engine.steps for q in s.query_lens), "no chunked prefill"
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_reserved_blocks == 0


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [24, 4096])
def test_greedy_matches_transformers_on_gpu_fp32(checkpoint, budget):
    """Triton kernels, CUDA graphs (decode and mixed steps; chunked prefill with the small
    budget) and overlapped steps, in fp32: exactly transformers'."""
    engine = InProcessEngine(device="cuda", model=checkpoint, dtype="float32", max_batch_size=8,
                             max_num_batched_tokens=budget, max_num_tokens=4096)
    check_parity(checkpoint, engine, ragged_workload(seed=11), device="cuda")
    runner = engine.worker.runner
    assert runner.num_graph_replays > 0 and runner.num_mixed_replays > 0


class EagerReplay:
    """A stand-in for a captured mixed-step graph on CPU: replay() reruns the graph's body on
    its static buffers and writes the same output tensor, as a CUDA graph replay does."""

    def __init__(self, graphs, t, r):
        self.graphs, self.t, self.r = graphs, t, r
        self.args = graphs._args(t, r)
        self.out = graphs._run(t, r, self.args).clone()

    def replay(self):
        self.out.copy_(self.graphs._run(self.t, self.r, self.args))


@pytest.mark.parametrize("budget", [24, 4096])
def test_mixed_step_graph_padding_matches_transformers(budget):
    """The mixed-step graphs' path on CPU (graphs replaced by EagerReplay): steps padded to
    token and request buckets, padding tokens in the scratch block, the LM head after the
    graph. The budget of 24 chunks prompts inside the smallest token bucket."""
    from engine_actors.cuda_graphs import MixedGraphs
    engine = InProcessEngine(model=DEFAULT_MODEL, max_batch_size=8,
                             max_num_batched_tokens=budget, max_num_tokens=4096)
    runner = engine.worker.runner
    graphs = MixedGraphs(runner.model, runner.kv_caches, runner.block_table[runner.pad_row],
                         runner.block_size, budget, 8, runner.dtype)
    for t in [t for t in graphs.token_sizes if t <= 384]:  # this workload's steps fit
        for r in graphs.request_sizes:
            replay = EagerReplay(graphs, t, r)
            graphs.graphs[t, r] = (replay, replay.out)
    runner.mixed = graphs
    check_parity(resolve_model_path(DEFAULT_MODEL), engine, ragged_workload(seed=5))
    assert runner.num_mixed_replays > 0


def test_builtin_default_model_matches_transformers():
    engine = InProcessEngine(model=DEFAULT_MODEL, max_batch_size=6)
    check_parity(resolve_model_path(DEFAULT_MODEL), engine, ragged_workload(seed=7))


def shared_prefix_workload(model: str, seed: int = 4):
    """Prompts sharing a prefix up to a block boundary (block_size 4), one token past it,
    the whole prompt, the whole prompt and more, a second turn over the first one's answer;
    arriving over many iterations, some growing their KV as they go (preemptible)."""
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(37)]

    def tail(n):
        return [rng.randrange(256) for _ in range(n)]

    first_answer = hf_greedy(model, base, 8)
    prompts = [base, base[:16] + tail(9), base[:17] + tail(6), base, base + tail(5),
               base[:16] + tail(12), base + first_answer + tail(3), base[:17] + tail(2)]
    prompts += [base[:rng.choice([4, 16, 17, 36])] + tail(rng.randint(1, 20))
                for _ in range(10)]
    arrivals = {}
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=8 if i == 0 else rng.randint(1, 24),
                                  temperature=0.0, ignore_eos=True,
                                  max_tokens_given=i % 3 != 1)
        arrivals.setdefault(0 if i == 0 else 12 + 3 * i + rng.randint(0, 3), []).append(
            (f"r{i}", prompt, sampling))
    return arrivals


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_matches_transformers_with_prefix_caching(checkpoint, overlap):
    """Cached prefix blocks reused across requests, a KV pool small enough to evict them
    and preempt requests (recomputed ones hit their own blocks): still exactly
    transformers' tokens."""
    engine = InProcessEngine(model=checkpoint, max_batch_size=8, block_size=4,
                             max_num_batched_tokens=32, max_num_tokens=160,
                             async_scheduling=overlap)
    check_parity(checkpoint, engine, shared_prefix_workload(checkpoint))
    s = engine.scheduler
    assert s.kv.num_hit_tokens >= 5 * 16, "the shared prefixes were not reused"
    assert s.num_preemptions > 0, "the pool should have forced preemptions"
    assert s.kv.num_free_blocks == s.kv.num_blocks
