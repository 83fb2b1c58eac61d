"""Logits processors and log-probabilities against transformers on the same fp32 model:
penalties, logit bias, min_tokens and allowed_token_ids give transformers' greedy tokens,
logprobs equal its log-softmax; requests with and without them share iterations (ragged, chunked prefill)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList,
                          MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from engine_actors.checkpoint import EOS_ID, resolve_model_path
from engine_actors.config import DEFAULT_MODEL
from engine_actors.logits_processors import LogitsProcessors, top_logprobs, unpack_logprobs
from engine_actors.messages import ProcessorSettings
from engine_actors.request import SamplingParams
from engine_actors.transfer import Staging
from tests.engine_harness import InProcessEngine, hf_model

MODEL = resolve_model_path(DEFAULT_MODEL)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (reference)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


class AllowedTokens(LogitsProcessor):
    """Every token but these masked (reference for allowed_token_ids)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, input_ids, scores):
        out = torch.full_like(scores, float("-inf"))
        out[:, self.ids] = scores[:, self.ids]
        return out


class BadWords(LogitsProcessor):
    """vLLM's bad_words (reference): a word's last token is masked when the generated
    tokens (not the prompt's) end with the rest of it."""

    def __init__(self, prompt_len: int, words):
        self.prompt_len, self.words = prompt_len, words

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len:].tolist()
        scores = scores.clone()
        for *prefix, last in self.words:
            if not prefix or generated[len(generated) - len(prefix):] == prefix and \
                    len(generated) >= len(prefix):
                scores[:, last] = float("-inf")
        return scores


def reference(prompt: list[int], s: SamplingParams) -> list[int]:
    """transformers' greedy generate() with the same processors, in the engine's order."""
    processors = []
    if s.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.presence_penalty or s.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), s.presence_penalty, s.frequency_penalty))
    if s.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(i,): b for i, b in s.logit_bias}))
    if s.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), s.min_tokens, EOS_ID))
    if s.allowed_token_ids is not None:
        processors.append(AllowedTokens(s.allowed_token_ids))
    if s.bad_words:
        processors.append(BadWords(len(prompt), s.bad_words))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(MODEL).generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=s.max_tokens, eos_token_id=None if s.ignore_eos else EOS_ID,
            pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


SETTINGS = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(presence_penalty=1.5, frequency_penalty=0.7),
    dict(frequency_penalty=-1.0),
    dict(logit_bias=((65, 8.0), (66, 7.5), (10, -100.0))),
    dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias=((97, 3.0),)),
    # EOS made almost certain, but not before min_tokens: finishes with "stop" right after
    dict(logit_bias=((EOS_ID, 30.0),), min_tokens=5, ignore_eos=False),
    dict(allowed_token_ids=(3, 65, 97, 120, 255)),
    dict(allowed_token_ids=(10, 200), repetition_penalty=1.5),
    dict(),  # no processors, in the same iterations
]


def workload(seed=0):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(24):
        settings = dict(SETTINGS[i % len(SETTINGS)])
        ignore_eos = settings.pop("ignore_eos", True)
        sampling = SamplingParams(max_tokens=rng.randint(6, 20), temperature=0.0,
                                  ignore_eos=ignore_eos, **settings)
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        arrivals.setdefault(rng.randint(0, 12), []).append((f"r{i}", prompt, sampling))
    return arrivals


# overlapped steps or not; and a KV pool so small that requests are preempted and recomputed
ENGINES = [dict(async_scheduling=True), dict(async_scheduling=False),
           dict(scheduling_policy="priority", max_num_tokens=160)]


# the GPU (fp32, Triton attention, CUDA graphs): the processors and sampler on the device
# (a fixed KV pool: earlier GPU tests in the process hold memory the profile would count)
ON_GPU = pytest.param(dict(device="cuda", dtype="float32", block_size=16, max_num_tokens=4096),
                      marks=pytest.mark.gpu, id="gpu")


@pytest.mark.parametrize("engine_args", ENGINES + [ON_GPU])
def test_processors_give_transformers_greedy_tokens(engine_args):
    engine = InProcessEngine(**{"model": DEFAULT_MODEL, "max_batch_size": 8, "block_size": 4,
                                "max_num_batched_tokens": 24, **engine_args})
    arrivals = workload()
    outputs = engine.run(arrivals)
    if engine_args.get("max_num_tokens", 4096) < 4096:  # a pool made to preempt
        assert engine.scheduler.num_preemptions > 0
    for reqs in arrivals.values():
        for rid, prompt, sampling in reqs:
            assert outputs[rid] == reference(prompt, sampling), (rid, sampling)
    stopped = [rid for reqs in arrivals.values() for rid, _, s in reqs if s.min_tokens]
    assert all(len(outputs[rid]) == 6 and outputs[rid][-1] == EOS_ID for rid in stopped)


@pytest.mark.parametrize("engine_args", ENGINES + [ON_GPU])
def test_bad_words_give_the_reference_greedy_tokens(engine_args):
    """Words taken from each prompt's own greedy output (so they bite): one token, two and
    three; a word that the prompt's end would complete does not count (only generated
    tokens do)."""
    rng = random.Random(3)
    arrivals, free = {}, {}
    for i in range(8):
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 30))]
        plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        out = free[f"r{i}"] = reference(prompt, plain)
        words = ((out[0],), tuple(out[3:5]), tuple(out[6:9]), (prompt[-1], out[0]))
        sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                  bad_words=words[i % 3:] if i % 2 else words[1:3])
        arrivals.setdefault(rng.randint(0, 6), []).append((f"r{i}", prompt, sampling))
    engine = InProcessEngine(**{"model": DEFAULT_MODEL, "max_batch_size": 8, "block_size": 4,
                                "max_num_batched_tokens": 24, **engine_args})
    outputs = engine.run(arrivals)
    for reqs in arrivals.values():
        for rid, prompt, sampling in reqs:
            assert outputs[rid] == reference(prompt, sampling), (rid, sampling.bad_words)
            assert outputs[rid] != free[rid]


@pytest.mark.parametrize("engine_args", [ENGINES[0], ON_GPU])
def test_masks_that_leave_no_token_end_the_request_with_stop(engine_args):
    """Not token 0, which they did not allow: the request ends where nothing is left."""
    greedy = dict(max_tokens=5, temperature=0.0)
    cases = {  # id -> (sampling, its tokens)
        "eos-before-min-tokens": (SamplingParams(allowed_token_ids=(EOS_ID,), min_tokens=3,
                                                 logprobs=2, **greedy), []),
        "no-repeat": (SamplingParams(allowed_token_ids=(97,), bad_words=((97, 97),),
                                     ignore_eos=True, **greedy), [97]),
        "sampled": (SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True,
                                   allowed_token_ids=(97, 98), bad_words=((97,), (98,))), []),
    }
    prompt = [5, 80, 13]
    free = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = InProcessEngine(**{"model": DEFAULT_MODEL, "max_batch_size": 8,
                                "block_size": 4, **engine_args})
    outputs = engine.run({0: [(rid, prompt, s) for rid, (s, _) in cases.items()] +
                          [("free", prompt, free)]})
    for rid, (_, tokens) in cases.items():
        assert (outputs[rid], engine.finish_reasons[rid]) == (tokens, "stop"), rid
    assert outputs["free"] == reference(prompt, free)  # the batch's other rows go on


def hf_logprobs(tokens: list[int]) -> torch.Tensor:
    """log-softmax of transformers' fp32 logits at every position of `tokens`: [L, V]."""
    with torch.no_grad():
        logits = hf_model(MODEL)(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("engine_args", [ENGINES[0], dict(ENGINES[2], max_num_tokens=96),
                                         ON_GPU])
def test_logprobs_equal_transformers_log_softmax(engine_args):
    rng = random.Random(1)
    arrivals = {}
    for i in range(10):
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 60))]
        sampling = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0,
                                  ignore_eos=True, logprobs=rng.choice([0, 1, 5, 20]),
                                  prompt_logprobs=rng.choice([None, 0, 3]),
                                  presence_penalty=rng.choice([0.0, 1.0]))
        arrivals.setdefault(rng.randint(0, 6), []).append((f"r{i}", prompt, sampling))
    engine = InProcessEngine(**{"model": DEFAULT_MODEL, "max_batch_size": 8, "block_size": 4,
                                "max_num_batched_tokens": 16, **engine_args})  # chunked prompts
    outputs = engine.run(arrivals)
    if engine_args.get("max_num_tokens", 4096) < 4096:  # a pool made to preempt
        assert engine.scheduler.num_preemptions > 0
    for reqs in arrivals.values():
        for rid, prompt, s in reqs:
            full = prompt + outputs[rid]
            ref = hf_logprobs(full)
            got = engine.logprobs[rid]
            assert len(got) == len(outputs[rid])
            for j, (lp, ids, values, _) in enumerate(got):
                row = ref[len(prompt) - 1 + j]  # the distribution the j-th token came from
                assert abs(lp - row[outputs[rid][j]].item()) < 1e-4
                top = row.topk(s.logprobs)
                assert ids == top.indices.tolist()
                torch.testing.assert_close(torch.tensor(values), top.values, atol=1e-4, rtol=0)
            if s.prompt_logprobs is None:
                assert not engine.prompt_logprobs[rid]
                continue
            got = engine.prompt_logprobs[rid]
            assert len(got) == len(prompt) - 1  # every prompt token but the first
            for p, (lp, ids, _, rank) in enumerate(got):
                assert abs(lp - ref[p, prompt[p + 1]].item()) < 1e-4
                assert ids == ref[p].topk(s.prompt_logprobs).indices.tolist()
                # vLLM's rank: 1 + the tokens at least as likely (up to fp32 noise)
                own = ref[p, prompt[p + 1]]
                assert (ref[p] > own + 1e-4).sum() + 1 <= rank <= (ref[p] >= own - 1e-4).sum()


def test_logprobs_of_broken_logits_become_vllms_floor_not_invalid_json():
    """A checkpoint whose logits hold NaN or -inf: the values shown are -9999.0, as vLLM
    shows -inf, so the response is still JSON (json.dumps refuses NaN here)."""
    logits = torch.tensor([[0.5, float("-inf"), 0.1], [float("nan"), 1.0, 0.0]])
    packed = top_logprobs(logits, torch.tensor([1, 2]), 2).tolist()
    for row in packed:
        chosen, _, top, _ = unpack_logprobs(row, 2)
        json.dumps([chosen, top], allow_nan=False)
    assert unpack_logprobs(packed[0], 2)[0] == -9999.0  # the chosen token's logit was -inf
    assert unpack_logprobs(packed[1], 2)[2] == [-9999.0, -9999.0]


def test_bad_words_look_back_at_a_recomputed_requests_tokens():
    """A request admitted again after preemption brings its last generated tokens: a word
    it was in the middle of is still caught; each sampled token moves the window on."""
    cpu = torch.device("cpu")
    processors = LogitsProcessors(4, cpu, Staging(cpu))
    processors.add(1, ProcessorSettings(3, bad_words=((5, 6, 7), (9,)), recent=(5, 6)))
    processors.add(2, ProcessorSettings(3, bad_words=((5, 6, 7),), recent=(6, 5)))
    rows = torch.tensor([1, 2])
    out = processors.apply(torch.zeros(2, 10), [1, 2], rows)
    assert out[0, 7] == out[0, 9] == float("-inf") and out[1].isfinite().all()
    processors.sampled([1, 2], rows, torch.tensor([3, 6]))  # row 1: (6, 3); row 2: (5, 6)
    out = processors.apply(torch.zeros(2, 10), [1, 2], rows)
    assert out[0, 7] == 0 and out[0, 9] == float("-inf") and out[1, 7] == float("-inf")
    processors.add(1, None)  # the row's next request has no bad words
    assert processors.apply(torch.zeros(2, 10), [1, 2], rows)[0].isfinite().all()


def test_more_logprobs_than_the_vocabulary_give_the_whole_vocabulary():
    """The workers' bound (max_logprobs -1 lets a request ask for up to the vocabulary; the
    ingress stops anything past it): every token's alternatives, none more."""
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1000,
                              prompt_logprobs=1000)
    engine = InProcessEngine(model=DEFAULT_MODEL, max_batch_size=4)
    prompt = [72, 101, 108, 108]
    outputs = engine.run({0: [("r", prompt, sampling)]})
    ref = hf_logprobs(prompt + outputs["r"])
    vocab = ref.shape[-1]
    for j, (_, ids, values, _) in enumerate(engine.logprobs["r"]):
        assert ids == ref[len(prompt) - 1 + j].topk(vocab).indices.tolist()
    assert all(len(ids) == vocab for _, ids, _, _ in engine.prompt_logprobs["r"])
