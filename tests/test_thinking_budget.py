"""vLLM's thinking_token_budget (engine_actors/thinking_budget.py): a reasoning model that
has thought for the budget's tokens writes </think> next, then answers as it would have
after writing it itself. Checked against transformers' greedy tokens, with overlapped steps
and with a pool so small that requests are preempted and recomputed; and the request
fields that carry it (chat's thinking_token_budget, the Messages API's thinking)."""
from __future__ import annotations

import concurrent.futures
import json
import random

import pytest
import torch

from deployments.protocol import APIError
from deployments.reasoning import think_token_ids, thinking_budget
from deployments.request_body import parse_body
from engine_actors.request import SamplingParams
from engine_actors.thinking_budget import ThinkingBudget
from engine_actors.transfer import Staging
from tests.engine_harness import InProcessEngine, hf_greedy
from tests.test_logits import ENGINES, ON_GPU
from tests.test_reasoning_grammar import model_dir, tokenizer  # noqa: F401 (fixtures)


def _budgeted(model_dir, prompt: list[int], budget: int, max_tokens: int, end: int):
    """transformers' greedy tokens when the output starts in thinking (DeepSeek-R1's
    templates) and </think> is forced after `budget` tokens."""
    thought = hf_greedy(model_dir, prompt, min(budget, max_tokens)) if budget else []
    assert end not in thought  # (the random model does not write it: checked)
    if len(thought) == max_tokens:
        return thought
    rest = max_tokens - budget - 1
    return thought + [end] + (hf_greedy(model_dir, prompt + thought + [end], rest) if rest else [])


@pytest.mark.parametrize("engine_args", ENGINES + [ON_GPU])
def test_the_budget_forces_the_end_of_thinking_then_the_answer_goes_on(model_dir, tokenizer,
                                                                       engine_args):
    start, end = think_token_ids(tokenizer)
    engine = InProcessEngine(**{"model": model_dir, "max_batch_size": 8, "block_size": 4,
                                "max_num_batched_tokens": 24, **engine_args})
    rng = random.Random(0)
    arrivals, expected = {}, {}
    for i in range(12):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        budget, max_tokens = rng.choice([0, 1, 3, 7, 30]), rng.randint(4, 16)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  thinking_budget=(-1, end, budget))
        arrivals.setdefault(rng.randint(0, 8), []).append((f"r{i}", prompt, sampling))
        expected[f"r{i}"] = _budgeted(model_dir, prompt, budget, max_tokens, end)
    # Qwen3's way: thinking only after a first <think> (forced here by a bias, which keeps
    # it coming after </think>: the end is forced once); and an output that does not start
    # with <think> is never forced
    bias = ((start, 100.0),)
    arrivals[0] += [("qwen3", [1, 2, 3], SamplingParams(
        max_tokens=9, temperature=0.0, ignore_eos=True, logit_bias=bias,
        thinking_budget=(start, end, 3))), ("answer", [5, 6], SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True, thinking_budget=(start, end, 0)))]
    expected["qwen3"] = [start] * 4 + [end] + [start] * 4
    expected["answer"] = hf_greedy(model_dir, [5, 6], 6)
    outputs = engine.run(arrivals)
    if engine_args.get("max_num_tokens", 4096) < 4096:  # a pool made to preempt
        assert engine.scheduler.num_preemptions > 0
    assert outputs == expected


@pytest.mark.parametrize("budget,generated,thinking", [
    ((-1, 9, 2), (), True), ((-1, 9, 2), (4, 5), True), ((-1, 9, 2), (4, 9, 5), False),
    ((8, 9, 2), (), False), ((8, 9, 2), (8, 4), True), ((8, 9, 2), (8, 9), False),
    ((8, 9, 2), (4, 8), False)])
def test_a_recomputed_request_resumes_in_the_state_its_tokens_left(budget, generated,
                                                                  thinking):
    cpu = torch.device("cpu")
    state = ThinkingBudget(4, cpu, Staging(cpu))
    state.add(1, budget, generated)
    assert bool(state.is_thinking[1]) is thinking
    state.add(1, None)  # a next request of the row has no budget: nothing is left over
    assert not state.rows and int(state.end[1]) == -1 and not state.is_thinking[1]


def test_the_fields_carry_the_budget_or_are_refused_without_a_reasoning_model(tokenizer):
    from deployments.chat_protocol import ChatCompletionRequest
    from deployments.messages_protocol import MessagesRequest
    start, end = think_token_ids(tokenizer)
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                  "thinking_token_budget": 5}).encode(), ChatCompletionRequest)
    assert thinking_budget(chat, "deepseek_r1", tokenizer) == (-1, end, 5)
    assert thinking_budget(chat, "qwen3", tokenizer) == (start, end, 5)
    unlimited = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                       "thinking_token_budget": -1}).encode(),
                           ChatCompletionRequest)  # (vLLM's "no limit")
    assert thinking_budget(unlimited, "qwen3", tokenizer) is None
    for parser in (None, "qwen3"):
        with pytest.raises(APIError) as e:
            thinking_budget(chat, parser, _byte_tokenizer() if parser else tokenizer)
        assert e.value.status == 400 and e.value.param == "thinking_token_budget"
    msg = parse_body(json.dumps({
        "model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 1500}}).encode(), MessagesRequest)
    assert msg.chat().template_variables() == {"enable_thinking": True}
    assert msg.thinking.budget_tokens == 1500


def _byte_tokenizer():
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.config import DEFAULT_MODEL
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


# ---- over HTTP: a server with the deepseek_r1 parser on the model with <think> tokens ------
@pytest.fixture(scope="module")
def url(model_dir):
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(model=model_dir, reasoning_parser="deepseek_r1",
                               served_model_name="thinker"))
    stop_app()


@pytest.mark.own_server
def test_the_budget_reaches_the_engine_from_both_routes(url, model_dir, tokenizer):
    """Chat's thinking_token_budget and the Messages API's thinking.budget_tokens: the
    reasoning stops at the budget, and the answer is transformers' greedy continuation
    after a forced </think>. At the Messages API's least budget (1,024) a logit bias keeps
    the random model from writing </think> itself; its answer is the chat route's."""
    import httpx
    end = think_token_ids(tokenizer)[1]
    messages = [{"role": "user", "content": "Why?"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    body = {"model": "thinker", "messages": messages, "temperature": 0, "ignore_eos": True}
    expected = _budgeted(model_dir, prompt, 6, 12, end)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        **body, "max_tokens": 12, "thinking_token_budget": 6})
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == tokenizer.decode(expected[:6]).strip("\n"), r.text
    assert message["content"] == tokenizer.decode(expected[7:]).lstrip("\n")
    long = {**body, "max_tokens": 1030, "logit_bias": {str(end): -100}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (batched: half the time)
        chat_call = pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=120, json={
            **long, "thinking_token_budget": 1024, "return_token_ids": True})
        messages_call = pool.submit(httpx.post, f"{url}/v1/messages", timeout=120, json={
            **long, "thinking": {"type": "enabled", "budget_tokens": 1024}})
        r, m = chat_call.result(), messages_call.result()
    chat = r.json()["choices"][0]
    ids = chat["token_ids"]  # (transformers' tokens at a budget: the engine test above)
    assert len(ids) == 1030 and end not in ids[:1024] and ids[1024] == end, r.text
    content = m.json()["content"]
    assert [b["type"] for b in content] == ["thinking", "text"], m.text
    assert (content[0]["thinking"], content[1]["text"]) == \
        (chat["message"]["reasoning"], chat["message"]["content"])
