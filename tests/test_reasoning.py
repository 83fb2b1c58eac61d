"""Reasoning models (`reasoning_parser`) and chat_template_kwargs: the split of <think>...
</think> from the answer, whatever the deltas; grammars that apply after the reasoning;
the chat and Responses stream formats with reasoning, against the openai client's models;
template variables; and, over HTTP on a server with the deepseek_r1 parser, the tiny model's
greedy output returned as reasoning on both routes, streamed or not."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine's image

from deployments.logprobs import LogprobsWriter  # noqa: E402
from deployments.protocol import APIError  # noqa: E402
from deployments.reasoning import ReasoningStream  # noqa: E402
from deployments.choice import Choice  # noqa: E402
from deployments.responses import SSEWriter  # noqa: E402
from deployments.response_output import ResponseEvents, ResponseObject  # noqa: E402
from deployments.tool_parsers import ToolCallStream, make_parser  # noqa: E402
from engine_actors.checkpoint import load_tokenizer, resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from engine_actors.detokenizer import TextStream  # noqa: E402
from engine_actors.messages import RequestUpdate  # noqa: E402
from tests.engine_harness import hf_greedy  # noqa: E402
from tests.test_responses_api import MODEL, parse, to_chat  # noqa: E402
from tests.test_structured_output import SCHEMA, WEATHER  # noqa: E402

pytestmark = pytest.mark.own_server  # conftest runs these modules last

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(reasoning_parser="deepseek_r1"))
    stop_app()


# ---- without a server --------------------------------------------------------------------
@pytest.mark.parametrize("parser,text,reasoning,answer", [
    ("qwen3", "<think>\nLet me see.\n\nOk.\n</think>\n\nIt is 4.", "Let me see.\n\nOk.",
     "It is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # thinking off
    ("qwen3", "<think>\nstill going", "still going", ""),  # cut before </think>
    ("qwen3", "<thin", "", "<thin"),
    ("deepseek_r1", "Let me see.\n</think>\n\nFour.", "Let me see.", "Four."),
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\nFour.", "Let me see.", "Four."),
    ("deepseek_r1", "still thinking </thi", "still thinking </thi", ""),
])
def test_the_split_does_not_depend_on_where_deltas_break(parser, text, reasoning, answer):
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = ReasoningStream(parser)
        parts = [stream.add(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert ("".join(r for r, _ in parts), "".join(a for _, a in parts)) == \
            (reasoning, answer), pieces


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_grammar_applies_to_the_answer_after_the_reasoning(parser, tokenizer):
    import xgrammar as xgr

    from deployments.chat_protocol import Tool
    from deployments.structured import reasoning_grammar, tool_grammar
    from engine_actors.grammar import Grammars
    grammars = Grammars(resolve_model_path(DEFAULT_MODEL), len(tokenizer))
    person = json.dumps({"name": "ann", "age": 3, "address": {"city": "rome"}, "tags": [],
                         "nick": "a"})
    call = '<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Rome", "days": 2, "unit": "C"}}\n</tool_call>'
    opening = "<think>" if parser == "qwen3" else ""

    def takes(spec, text: str) -> bool:  # the byte-level tokenizer's ids are the bytes
        matcher = xgr.GrammarMatcher(grammars._compile(reasoning_grammar(spec, parser)))
        return all(matcher.accept_token(t) for t in text.encode()) and \
            matcher.accept_token(tokenizer.eos_token_id)
    schema = ("json_schema", json.dumps(SCHEMA))
    assert takes(schema, f"{opening}\nHm, <b> {{}}.\n</think>\n\n{person}")
    assert not takes(schema, f"{opening}\nHm.\n</think>\n\nno json")
    assert not takes(schema, f"{opening}Hm.</think>{person}</think>")
    assert takes(schema, person) == (parser == "qwen3")  # thinking may be off for qwen3
    forced = tool_grammar([Tool.model_validate(WEATHER)], "required", "hermes")
    assert takes(forced, f"{opening}I will call it.</think>\n\n{call}")
    assert takes(("regex", "(yes|no)"), f"{opening}Hm.</think>\nno")


def _feed(choice: Choice, writer, tokenizer, text: str, step: int = 3) -> list:
    """Events of `text` fed `step` tokens at a time (each token's log-probability: minus
    its index, when the choice takes them)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    events = writer.start({"": choice})
    for start in range(0, len(ids), step):
        last = start + step >= len(ids)
        chunk = ids[start:start + step]
        logprobs = [(-float(start + k), [], []) for k in range(len(chunk))]
        delta = choice.consume(RequestUpdate(chunk, "stop" if last else None,
                                             logprobs=logprobs))
        events += writer.update(choice, delta)
    return events + asyncio.run(writer.finish({"": choice})) + writer.done()


OUTPUT = '<think>\nThe user wants Rome.\n</think>\n\nSure. <tool_call>\n{"name": ' \
         '"get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def _choice(tokenizer, parser: str = "qwen3", logprobs: bool = False) -> Choice:
    return Choice(0, 0, TextStream(tokenizer), [1, 2, 3], None,
                  logprobs=LogprobsWriter(tokenizer, True) if logprobs else None,
                  tools=ToolCallStream(make_parser("hermes")),
                  reasoning=ReasoningStream(parser))


def test_chat_chunks_carry_reasoning_and_the_call_is_parsed_from_the_answer(tokenizer):
    from openai.types.chat import ChatCompletionChunk
    req = to_chat({"input": "hi"})
    choice = _choice(tokenizer)
    chunks = [json.loads(e) for e in _feed(choice, SSEWriter("c", MODEL, True, req),
                                           tokenizer, OUTPUT)[:-1]]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "The user wants Rome."
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}]
    message = choice.message()
    assert (message["reasoning"], message["content"]) == ("The user wants Rome.", "Sure.")
    assert choice.num_reasoning_tokens == len(tokenizer.encode(
        "<think>\nThe user wants Rome.\n</think>", add_special_tokens=False))


def test_responses_events_put_a_reasoning_item_first(tokenizer):
    from typing import get_args

    from openai.types.responses import Response, ResponseStreamEvent
    union = get_args(ResponseStreamEvent)[0]
    models = {get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(union)}
    choice = _choice(tokenizer)
    response = ResponseObject(parse({"input": "hi"}), MODEL, 1.0, 1.0)
    data = [json.loads(e["data"]) for e in _feed(choice, ResponseEvents(response),
                                                 tokenizer, OUTPUT)]
    for d in data:
        models[d["type"]].model_validate(d)
    final = Response.model_validate(data[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "The user wants Rome."
    assert final.output_text == "Sure."
    assert final.usage.output_tokens_details.reasoning_tokens == choice.num_reasoning_tokens > 0
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.reasoning_text.delta")
    assert deltas == final.output[0].content[0].text
    added = [(d["output_index"], d["item"]["type"]) for d in data
             if d["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message"), (2, "function_call")]


def test_the_answer_logprobs_leave_out_the_reasoning_tokens(tokenizer):
    """deepseek_r1 (no <think> written) and a </think> of several tokens: the count of
    reasoning tokens is found in the decoded text."""
    reasoning = "a few thoughts\n</think>\n\n"
    choice = _choice(tokenizer, "deepseek_r1", logprobs=True)
    response = ResponseObject(parse({"input": "hi"}), MODEL, 1.0, 1.0)
    data = [json.loads(e["data"]) for e in _feed(choice, ResponseEvents(response), tokenizer,
                                                 reasoning + "Hello there")]
    first = len(tokenizer.encode(reasoning.rstrip(), add_special_tokens=False))
    assert choice.num_reasoning_tokens == first
    final = data[-1]["response"]
    entries = final["output"][1]["content"][0]["logprobs"]
    assert "".join(e["token"] for e in entries) == "\n\nHello there"  # from the token after
    assert entries[0]["logprob"] == -float(first)
    streamed = [e for d in data if d["type"] == "response.output_text.delta" for e in d["logprobs"]]
    assert streamed == entries
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == first


def test_a_grammar_that_can_not_follow_reasoning_is_a_400_naming_its_field():
    from deployments.chat_protocol import ChatCompletionRequest
    from deployments.structured import grammar_for
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], guided_regex="")
    assert grammar_for(req) == ("regex", "")  # fine alone
    with pytest.raises(APIError) as info:
        grammar_for(req, "qwen3")
    assert (info.value.status, info.value.param) == (400, "guided_regex")


def test_reasoning_items_sent_back_go_to_the_template_with_their_turn():
    chat = to_chat({"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                          "text": "greet back"}]},
        {"type": "message", "role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"}]})
    assert [m.for_template() for m in chat.messages] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        {"role": "user", "content": "bye"}]


def test_chat_template_kwargs_are_template_variables(tokenizer):
    from deployments.chat_protocol import ChatCompletionRequest, ChatMessage
    from deployments.app import build_app
    from deployments.frontend import Frontend
    from engine_actors.config import ConfigError, EngineConfig
    template = tokenizer.chat_template + \
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    frontend = Frontend(EngineConfig(default_chat_template_kwargs={"enable_thinking": False}))
    frontend.tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    frontend.tokenizer.chat_template = template
    messages = [ChatMessage(role="user", content="hi")]

    def text(kwargs=None) -> str:
        return tokenizer.decode(asyncio.run(frontend.chat_ids(messages, None,
                                                              template_kwargs=kwargs)))
    assert text().endswith("<think></think>")  # the server's default
    assert not text({"enable_thinking": True}).endswith("</think>")  # the request's, over it
    with pytest.raises(APIError) as info:
        ChatCompletionRequest(messages=messages, chat_template_kwargs={"tokenize": True}) \
            .check_supported()
    assert info.value.param == "chat_template_kwargs.tokenize"
    with pytest.raises(APIError) as info:  # the template's own variable (once a jinja error)
        ChatCompletionRequest(messages=messages, chat_template_kwargs={"messages": []}) \
            .check_supported()
    assert info.value.param == "chat_template_kwargs.messages"
    for key in ("chat_template", "tokenize", "conversation", "messages"):
        with pytest.raises(ConfigError, match=key):
            build_app({"default_chat_template_kwargs": {key: "x"}})


# ---- over HTTP, deepseek_r1: the tiny model never writes </think>, so all is reasoning -----
def test_the_greedy_output_is_reasoning_on_both_routes(url, tokenizer):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Why?"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    expected = tokenizer.decode(hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 12),
                                skip_special_tokens=True)
    assert "</think>" not in expected
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                  extra_body=NO_EOS)
    answer = client.chat.completions.create(**kwargs)
    message = answer.choices[0].message
    assert (message.reasoning, message.content) == (expected.lstrip("\n"), None)
    assert answer.usage.completion_tokens_details.reasoning_tokens == 12  # (vLLM's)
    hidden = client.chat.completions.create(**{**kwargs, "extra_body": {
        **NO_EOS, "include_reasoning": False}})  # vLLM's: the reasoning is left out
    assert (hidden.choices[0].message.reasoning, hidden.choices[0].message.content) == \
        (None, "")
    assert hidden.usage.completion_tokens_details.reasoning_tokens == 12
    quiet = list(client.chat.completions.create(stream=True, **{**kwargs, "extra_body": {
        **NO_EOS, "include_reasoning": False}}))
    assert not any(getattr(c.choices[0].delta, "reasoning", None) for c in quiet if c.choices)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks
                       if c.choices)
    assert streamed == message.reasoning
    res = client.responses.create(model=MODEL, input="Why?", max_output_tokens=12,
                                  temperature=0, extra_body=NO_EOS)
    assert [item.type for item in res.output] == ["reasoning"]
    assert res.output[0].content[0].text == message.reasoning
    assert res.usage.output_tokens_details.reasoning_tokens == res.usage.output_tokens == 12
    assert res.status == "incomplete" and res.output[0].status == "incomplete"


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(tokenizer):
    """reasoning_effort (chat) and reasoning.effort (Responses): the template variable, and
    enable_thinking off for "none" (Qwen3's switch) unless chat_template_kwargs sets it."""
    from deployments.chat_protocol import ChatCompletionRequest, ChatMessage
    from deployments.frontend import Frontend
    from deployments.openai_api import OpenAIRoutes
    from deployments.request_body import parse_body
    from engine_actors.config import EngineConfig
    frontend = Frontend(EngineConfig())
    frontend.tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    frontend.tokenizer.chat_template = "{{ reasoning_effort }}|{{ enable_thinking }}"
    routes = OpenAIRoutes(frontend)

    def rendered(req) -> str:
        ids, _, _ = asyncio.run(routes.chat_prompt(req, None))
        return tokenizer.decode(ids)

    def chat(**fields) -> str:
        return rendered(ChatCompletionRequest(
            messages=[ChatMessage(role="user", content="hi")], **fields))
    assert chat() == "|"
    assert chat(reasoning_effort="none") == "none|False"
    assert chat(reasoning_effort="high") == "high|True"
    assert chat(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == \
        "low|False"
    assert chat(reasoning_effort="max", chat_template_kwargs={"reasoning_effort": "x"}) == \
        "max|True"
    assert rendered(to_chat({"input": "hi", "reasoning": {"effort": "none",
                                                          "summary": "auto"}})) == "none|False"
    echoed = ResponseObject(parse({"input": "hi", "reasoning": {"effort": "low"}}), MODEL, 1.0,
                            1.0).settings["reasoning"]
    assert echoed == {"effort": "low", "summary": None}
    with pytest.raises(APIError) as info:
        parse_body(b'{"messages": [{"role": "user", "content": "a"}], '
                   b'"reasoning_effort": "huge"}', ChatCompletionRequest)
    assert info.value.status == 400 and info.value.param == "reasoning_effort"
