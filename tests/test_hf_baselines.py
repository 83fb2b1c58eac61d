"""The transformers baselines of the offline benchmark against per-request model.generate.

The reference is computed independently of the code under test: one request at a time, no
padding, no batching, with EOS disabled (eos_token_id=-1 never matches a token, so it neither
stops generation nor masks a logit) and exactly max_tokens new tokens.
"""
from __future__ import annotations

import copy

import pytest
import torch

from engine_actors.checkpoint import save_random_llama
from load_tests.hf_baselines import run_continuous_batching, run_static_batches
from load_tests.traces import orca_trace

# A small KV cache: the library defaults size the cache (and paged sdpa's attention mask) from
# free memory, about 15 GB of host RAM and 15 s on CPU, so they run only in the GPU test. With
# max_batch_tokens below the trace's prompt total, scheduling spans several steps.
SMALL_CB = {"num_blocks": 16, "max_batch_tokens": 64}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_random_llama(path, seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trace():
    return orca_trace(num_requests=6, vocab_size=256, seed=0, prompt_len=(2, 20), output_len=(1, 8))


def _reference(model, trace):
    out = []
    for r in trace:
        ids = torch.tensor([r.prompt_token_ids], device=model.device)
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=r.max_tokens, eos_token_id=-1, pad_token_id=0)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def reference(model, trace):
    return _reference(model, trace)


def _check(result, trace, reference):
    assert result.num_requests == len(trace)
    assert result.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in trace)
    assert [len(o) for o in result.outputs] == [r.max_tokens for r in trace]
    assert result.num_generated_tokens == sum(r.max_tokens for r in trace)
    assert result.outputs == reference
    assert result.elapsed_s > 0


def test_reference_is_meaningful(trace, reference):
    # Lengths vary (so a batch's longest request outlives the others) and each reference has
    # exactly max_tokens tokens.
    assert len({r.max_tokens for r in trace}) > 1
    assert len({len(r.prompt_token_ids) for r in trace}) > 1
    assert [len(o) for o in reference] == [r.max_tokens for r in trace]


@pytest.mark.parametrize("batch_size", [4, 32])
def test_static_batches_match_generate(model, trace, reference, batch_size):
    result = run_static_batches(model, trace, batch_size=batch_size, warmup=2)
    _check(result, trace, reference)


def test_continuous_batching_matches_generate(model, trace, reference):
    result = run_continuous_batching(model, trace, cb_config=SMALL_CB, warmup=2)
    _check(result, trace, reference)


@pytest.mark.gpu
def test_baselines_on_cuda_with_library_defaults(model, trace):
    cuda_model = copy.deepcopy(model).to("cuda")
    reference = _reference(cuda_model, trace)
    _check(run_static_batches(cuda_model, trace, batch_size=4, warmup=2), trace, reference)
    _check(run_continuous_batching(cuda_model, trace, cb_config=None, warmup=2), trace, reference)


def test_continuous_batching_rejects_unknown_config_key(model, trace):
    with pytest.raises(ValueError, match="unknown ContinuousBatchingConfig key"):
        run_continuous_batching(model, trace, cb_config={"no_such_key": 1})


def test_eos_is_ignored(model, trace, reference, monkeypatch):
    """Make a token the reference emits early the model's EOS: plain generate now stops early,
    the baselines must still return the reference's max_tokens tokens."""
    i = max(range(len(trace)), key=lambda k: trace[k].max_tokens)
    eos = reference[i][0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    ids = torch.tensor([trace[i].prompt_token_ids])
    stopped = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=trace[i].max_tokens, pad_token_id=0)
    assert stopped.shape[1] - ids.shape[1] < trace[i].max_tokens  # the EOS really is live
    _check(run_static_batches(model, trace, batch_size=4), trace, reference)
    _check(run_continuous_batching(model, trace, cb_config=SMALL_CB), trace, reference)
