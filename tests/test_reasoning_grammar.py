"""A grammar after a reasoning model's thinking, when <think> and </think> are tokens of
their own (as in Qwen3 and DeepSeek-R1): the engine masks nothing while the model thinks,
and from the </think> token on masks exactly as the whole-output grammar does."""
from __future__ import annotations

import json

import pytest

from deployments.reasoning import END, START, think_token_ids
from deployments.structured import reasoning_grammar
from engine_actors.checkpoint import load_tokenizer, save_random_llama
from engine_actors.grammar import AfterThinking, Grammars
from engine_actors.request import SamplingParams
from tests.engine_harness import InProcessEngine, hf_greedy
from tests.test_structured_output import SCHEMA

PERSON = json.dumps({"name": "ann", "age": 3, "address": {"city": "rome"}, "tags": [],
                     "nick": "a"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random Llama with <think> and </think> added to its byte tokenizer."""
    path = str(tmp_path_factory.mktemp("thinking-model"))
    save_random_llama(path, vocab_size=260)
    tokenizer = load_tokenizer(path)
    tokenizer.add_tokens([START, END])
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def test_the_tags_are_found_as_single_tokens_or_not(tokenizer):
    start, end = think_token_ids(tokenizer)
    assert tokenizer.convert_ids_to_tokens([start, end]) == [START, END]
    assert think_token_ids(load_tokenizer(_byte_model_dir())) == (None, None)
    spec = ("json_schema", json.dumps(SCHEMA))
    assert reasoning_grammar(spec, "qwen3", think_ids=(None, end))[0] == "structural_tag"
    assert reasoning_grammar(spec, "deepseek_r1", think_ids=(None, end))[0] == "reasoning"


def _byte_model_dir() -> str:
    from engine_actors.checkpoint import resolve_model_path
    from engine_actors.config import DEFAULT_MODEL
    return resolve_model_path(DEFAULT_MODEL)


def _ids(tokenizer, *parts) -> list[int]:
    """Token ids of text parts; START and END as their own tokens."""
    ids = []
    for part in parts:
        ids += tokenizer.encode(part, add_special_tokens=False)
    return ids


@pytest.mark.parametrize("parser,output", [
    ("deepseek_r1", ["Let me <see>, </thi", END, "\n\n", PERSON]),
    ("deepseek_r1", [START, "hm", END, PERSON]),
    ("qwen3", [START, "\nLet me see.\n", END, "\n\n", PERSON]),
    ("qwen3", [PERSON]),  # thinking off: the answer from the first token
])
def test_masks_none_while_thinking_then_those_of_the_whole_grammar(model_dir, tokenizer,
                                                                   parser, output):
    """Step by step through an output: no mask while thinking; elsewhere each mask equals
    the whole-output grammar's at the same point, and the output is accepted to its end."""
    think_ids = think_token_ids(tokenizer)
    spec = ("json_schema", json.dumps(SCHEMA))
    grammars = Grammars(model_dir, 260)
    grammars.add(0, reasoning_grammar(spec, parser, think_ids=think_ids), [])
    grammars.add(1, reasoning_grammar(spec, parser), [])  # the whole-output grammar
    fast, whole = grammars.matchers[0], grammars.matchers[1]
    assert isinstance(fast, AfterThinking)
    ids = _ids(tokenizer, *output) + [tokenizer.eos_token_id]
    thinking = START in output or parser == "deepseek_r1"
    end_at = ids.index(think_ids[1]) if thinking else -1
    start_at = 0 if parser == "qwen3" and output[0] == START else -1
    for i, token in enumerate(ids):
        mask = grammars.bitmask([fast])
        if start_at < i <= end_at:
            assert mask is None, i
        else:
            assert (mask == grammars.bitmask([whole])).all(), i
            assert _allows(mask, token), i
        assert fast.accept_token(token) and whole.accept_token(token), i
    assert fast.is_terminated() and whole.is_terminated()


def _allows(mask, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def test_the_answer_is_held_to_its_grammar_after_the_end_token(model_dir, tokenizer):
    think_ids = think_token_ids(tokenizer)
    grammars = Grammars(model_dir, 260)
    spec = reasoning_grammar(("regex", "(yes|no)"), "deepseek_r1", think_ids=think_ids)
    grammars.add(0, spec, _ids(tokenizer, "hm", END))  # replayed after a preemption
    mask = grammars.bitmask([grammars.matchers[0]])
    allowed = {t for t in range(260) if _allows(mask, t)}
    assert allowed == set(_ids(tokenizer, "\n", "y", "n"))


def test_the_engine_samples_freely_while_thinking_and_under_the_grammar_after(model_dir,
                                                                             tokenizer):
    """In-process engine, greedy, deepseek_r1: the random model never writes </think>
    (checked), so its output is transformers' greedy output with no mask at all; with
    </think> forced first by a logit bias, the answer follows the choice's grammar."""
    think_ids = think_token_ids(tokenizer)
    end = think_ids[1]
    engine = InProcessEngine(model=model_dir, max_batch_size=4)
    prompt = _ids(tokenizer, "What is it?")
    schema = reasoning_grammar(("json_schema", json.dumps(SCHEMA)), "deepseek_r1",
                               think_ids=think_ids)
    choice = reasoning_grammar(("regex", "(yes|no)"), "deepseek_r1", think_ids=think_ids)
    outputs = engine.run({0: [
        ("free", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                        grammar=schema)),
        ("forced", prompt, SamplingParams(max_tokens=24, temperature=0.0, grammar=choice,
                                          logit_bias=((end, 100.0),))),
    ]})
    expected = hf_greedy(model_dir, prompt, 24)
    assert end not in expected
    assert outputs["free"] == expected
    forced = outputs["forced"]
    assert forced[0] == end and forced[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(forced[1:-1]).lstrip("\n") in ("yes", "no")
