"""The worker actor's own contract, in-process: step order, and random-weight models."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine_actors import checkpoint
from engine_actors.config import EngineConfig
from engine_actors.messages import NewRequest, StepInput
from engine_actors.worker import Worker
from tests.engine_harness import InProcessEngine


def prefill_step(row: int, tokens: list[int], block: int) -> StepInput:
    return StepInput(new_requests=[NewRequest(row, 0.0, 1.0, 0, None)], rows=[row],
                     context_lens=[0], query_lens=[len(tokens)], sample=[True],
                     token_ids=list(tokens), table_rows=[row], table_cols=[0],
                     table_blocks=[block])


def test_steps_run_in_step_id_order_whatever_the_delivery_order():
    cfg = EngineConfig.from_args({"max_num_tokens": 256, "block_size": 16})
    worker = Worker(cfg, "cpu")
    worker.setup(4096)
    worker.init_kv_cache(worker.num_kv_blocks())
    first = prefill_step(0, [1, 2, 3], block=0)
    # the second step decodes row 0 from its first sample: wrong if it ran first
    second = StepInput(rows=[0], context_lens=[3], query_lens=[1], sample=[True], token_ids=[-1])
    first.step_id, second.step_id = 0, 1

    async def deliver_out_of_order():
        later = asyncio.create_task(worker.execute(second))
        await asyncio.sleep(0.05)
        assert not later.done()  # waits for step 0
        return await worker.execute(first), await later

    out_first, out_second = asyncio.run(deliver_out_of_order())
    reference = Worker(cfg, "cpu")
    reference.setup(4096)
    reference.init_kv_cache(reference.num_kv_blocks())
    expect_first = reference.runner.execute(prefill_step(0, [1, 2, 3], block=0))
    expect_second = reference.runner.execute(
        StepInput(rows=[0], context_lens=[3], query_lens=[1], sample=[True],
                  token_ids=expect_first.token_ids))
    assert (out_first, out_second) == (expect_first, expect_second)


def test_random_weight_model_is_rebuilt_identically_by_transformers(monkeypatch):
    """A random-weight preset (weights generated from tensor names, never on disk) gives the
    engine and transformers the same weights: greedy outputs agree."""
    from load_tests.bench_offline import load_hf_model
    monkeypatch.setitem(checkpoint.RANDOM_MODELS, "llama-test", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    engine = InProcessEngine(model="llama-test", max_batch_size=4, max_num_tokens=1024)
    hf = load_hf_model("llama-test", "cpu")
    from engine_actors.request import SamplingParams
    prompts = [[5, 900, 77], [12] * 9, [127000, 3]]
    arrivals = {0: [(f"p{i}", p, SamplingParams(max_tokens=6, temperature=0.0,
                                                ignore_eos=True)) for i, p in enumerate(prompts)]}
    outputs = engine.run(arrivals)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=6, min_new_tokens=6, eos_token_id=None, pad_token_id=0)
        assert outputs[f"p{i}"] == ref[0, len(p):].tolist()
    weight = dict(hf.named_parameters())["model.layers.1.mlp.up_proj.weight"]
    assert weight.std().item() == pytest.approx(0.02, rel=0.1)
