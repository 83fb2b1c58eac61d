"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): request
conversion and refusals (no server), the streamed events against the anthropic client's own
event models and its stream accumulator, and over real HTTP with the official client:
greedy text equal to transformers', streaming, stop sequences, a prefill, structured
output, forced tool calls, a tool round trip rendered as the chat template renders the
equivalent messages, token counts and errors in Anthropic's shape."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")  # a test extra; absent on the GPU machine's image
jsonschema = pytest.importorskip("jsonschema")

from deployments.choice import Choice  # noqa: E402
from deployments.messages_output import MessageEvents, MessageObject  # noqa: E402
from deployments.messages_protocol import CountTokensRequest, MessagesRequest  # noqa: E402
from deployments.protocol import APIError  # noqa: E402
from deployments.reasoning import ReasoningStream  # noqa: E402
from deployments.request_body import parse_body  # noqa: E402
from deployments.tool_parsers import ToolCallStream, make_parser  # noqa: E402
from engine_actors.checkpoint import resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from engine_actors.detokenizer import TextStream  # noqa: E402
from engine_actors.messages import RequestUpdate  # noqa: E402
from tests.engine_harness import hf_greedy  # noqa: E402
from tests.serve_fixture import wait_idle  # noqa: E402
from tests.test_responses_api import ROUND_TRIP_CHAT, tokenizer  # noqa: E402,F401 (fixture)
from tests.test_structured_output import SCHEMA, WEATHER  # noqa: E402

MODEL = "tiny-random-llama"
NO_EOS = {"ignore_eos": True}
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
# ROUND_TRIP_CHAT's conversation as Anthropic's messages
ROUND_TRIP = [
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather",
         "input": {"city": "Oslo", "days": 2, "unit": "C"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "call_1",
         "content": [{"type": "text", "text": "sunny, 12 C"}]},
        {"type": "text", "text": "and tomorrow?"}]}]


def parse(body: dict, schema=MessagesRequest):
    return parse_body(json.dumps({"model": MODEL, "max_tokens": 16, **body}).encode(), schema)


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              **kwargs))


# ---- without a server ----------------------------------------------------------------------
def test_messages_become_chat_messages():
    chat = parse({"messages": ROUND_TRIP, "system": [{"type": "text", "text": "Be brief."}],
                  "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather",
                                                   "disable_parallel_tool_use": True},
                  "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                  "metadata": {"user_id": "u1"}, "priority": 2,
                  "output_config": {"effort": "low",
                                    "format": {"type": "json_schema", "schema": SCHEMA}}}).chat()
    assert [m.for_template() for m in chat.messages] == ROUND_TRIP_CHAT
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [WEATHER]
    assert chat.tool_choice.function.name == "get_weather" and not chat.parallel_tool_calls
    assert chat.response_format.json_schema.schema_ == SCHEMA
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop, chat.user,
            chat.priority, chat.reasoning_effort) == (16, 0.5, 0.9, 5, ["x"], "u1", 2, "low")
    assert chat.add_generation_prompt and not chat.continue_final_message
    # without `thinking`, no thinking (Anthropic's default); the beta's output_format
    assert chat.template_variables() == {"enable_thinking": False, "reasoning_effort": "low"}
    beta = parse({"messages": ROUND_TRIP, "output_format": {"type": "json_schema",
                                                            "schema": SCHEMA}}).chat()
    assert beta.response_format.json_schema.schema_ == SCHEMA    # "any" is "required"; thinking reaches the template as vLLM passes it
    assert parse({"messages": ROUND_TRIP, "tools": [TOOL],
                  "tool_choice": {"type": "any"}}).chat().tool_choice == "required"
    off = parse({"messages": ROUND_TRIP, "thinking": {"type": "disabled"}}).chat()
    assert off.template_variables() == {"enable_thinking": False, "reasoning_effort": "none"}
    on = parse({"messages": ROUND_TRIP, "max_tokens": 1024,  # (a budget may pass max_tokens:
                "thinking": {"type": "adaptive", "display": "omitted"},  # interleaved thinking)
                "chat_template_kwargs": {"x": 1}}).chat()
    assert on.template_variables() == {"enable_thinking": True, "x": 1}
    assert not on.include_reasoning  # "omitted": the model thinks, the answer shows none


def test_what_claude_code_sends_keeps_its_meaning_and_caches():
    """Its per-request billing header is dropped (so that turns share their prefix), text
    blocks go one per line, an image a tool returned becomes a line (the client sends it
    again with every later turn), an error result says so, and system messages after the
    first can be merged into it for templates that want them there."""
    from deployments.messages_content import system_first
    chat = parse({"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1; cch=9;"},
                             {"type": "text", "text": "You are Claude Code.",
                              "cache_control": {"type": "ephemeral"}}],
                  "messages": [
                      {"role": "user", "content": [
                          {"type": "text", "text": "<system-reminder>r</system-reminder>"},
                          {"type": "text", "text": "fix it"}]},
                      {"role": "assistant", "content": [
                          {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}},
                          {"type": "tool_use", "id": "toolu_2", "name": "Run", "input": {}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                              {"type": "text", "text": "a.png:"},
                              {"type": "image", "source": {"type": "base64", "data": "AA"}}]},
                          {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                           "content": "timeout"}]},
                      {"role": "system", "content": "Be careful."}]}).chat()
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "<system-reminder>r</system-reminder>\nfix it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Read", "arguments": {}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "Run", "arguments": {}}}]},
        {"role": "tool", "content": "a.png:\n[image left out: this model reads text only]",
         "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_2"},
        {"role": "system", "content": "Be careful."}]
    merged = system_first(chat.messages)
    assert [m.role for m in merged] == ["system", "user", "assistant", "tool", "tool"]
    assert merged[0].text() == "You are Claude Code.\n\nBe careful."
    assert system_first(merged) is None
    header = parse({"system": "x-anthropic-billing-header: cch=1;\nYou are here.",
                    "messages": [{"role": "user", "content": "hi"}]}).chat()
    assert header.messages[0].text() == "You are here."


def test_a_max_tokens_cut_to_the_context_reserves_no_kv(tokenizer):
    """Claude Code's max_tokens of 32,000 is a cap: cut to the context's rest, the engine
    request grows its KV as it goes (FCFS reserves prompt + max_tokens only for an
    estimate the client gave); a prefill gets no thinking budget."""
    from types import SimpleNamespace

    from deployments.openai_api import OpenAIRoutes
    submitted = []

    async def submit(reqs, wake_each_update):
        submitted.extend(reqs)
        return SimpleNamespace(close=lambda: None)

    cfg = SimpleNamespace(reasoning_parser="deepseek_r1", request_timeout_s=None,
                          fingerprint=lambda: "0", max_logprobs=20)
    frontend = SimpleNamespace(cfg=cfg, tokenizer=tokenizer, metrics=None,
                               refuse_if_draining=lambda: None, adapter=lambda req: None,
                               client=SimpleNamespace(submit=submit))
    info = SimpleNamespace(max_model_len=64, sampling_defaults={}, vocab_size=260,
                           eos_token_ids=(2,))
    routes = OpenAIRoutes(frontend)
    for max_tokens, given in [(32000, False), (40, True)]:
        chat = parse({"max_tokens": max_tokens, "messages": [{"role": "user", "content": "a"}]}
                     ).chat()
        asyncio.run(routes.submit("m", chat, [(None, list(range(20)))], max_tokens, info, True,
                                  0.0))
        sampling = submitted[-1].sampling
        assert (sampling.max_tokens, sampling.max_tokens_given) == (min(max_tokens, 44), given)
    prefill = parse({"max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024},
                     "messages": [{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}]}).chat()
    prefill.thinking_token_budget = 1024  # (as the route sets it with a reasoning parser)
    asyncio.run(routes.submit("m", prefill, [(None, [5, 6])], 8, info, True, 0.0))
    assert submitted[-1].sampling.thinking_budget is None


def test_a_template_that_wants_the_system_message_first_gets_them_merged():
    from types import SimpleNamespace

    from deployments.messages_api import MessagesAPI

    async def chat_prompt(chat, info):  # a template that refuses a late system message
        if any(m.role == "system" for m in chat.messages[1:]):
            raise APIError(400, "System message must be at the beginning", "messages")
        return [len(chat.messages)], None, None

    api = MessagesAPI(SimpleNamespace(frontend=None, chat_prompt=chat_prompt))
    late = parse({"messages": [{"role": "user", "content": "a"},
                               {"role": "system", "content": "b"}]}).chat()
    assert asyncio.run(api.prompt(late, None))[0] == [2]
    assert [m.role for m in late.messages] == ["system", "user"]
    # a system message first renders as it is
    first = parse({"messages": [{"role": "system", "content": "b"},
                                {"role": "user", "content": "a"}]}).chat()
    assert asyncio.run(api.prompt(first, None))[0] == [2]
    api.openai.chat_prompt = _raises  # another failure is not retried
    with pytest.raises(APIError, match="no"):
        asyncio.run(api.prompt(late, None))


async def _raises(chat, info):
    raise APIError(400, "no", "messages")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_prefill_is_continued_as_answer_not_reasoning(parser, tokenizer):
    """With a reasoning parser, the output that continues a last assistant message is
    answer text as it comes (no leading newlines dropped, nothing taken for thinking)."""
    from types import SimpleNamespace

    from deployments.choice import new_choice
    from engine_actors.request import SamplingParams
    frontend = SimpleNamespace(tokenizer=tokenizer,
                               cfg=SimpleNamespace(reasoning_parser=parser))
    engine_req = SimpleNamespace(sampling=SamplingParams(max_tokens=8))
    prefill = parse({"messages": [{"role": "user", "content": "json"},
                                  {"role": "assistant", "content": "{"}]}).chat()
    choice = new_choice(frontend, prefill, 0, None, [1], engine_req, True, None, None)
    ids = tokenizer.encode('\n "a": 1}', add_special_tokens=False)
    assert choice.consume(RequestUpdate(ids, "stop")) == '\n "a": 1}'
    assert choice.reasoning_text == ""
    plain = parse({"messages": [{"role": "user", "content": "json"}]}).chat()
    choice = new_choice(frontend, plain, 0, None, [1], engine_req, True, None, None)
    assert choice.reasoning is not None


def test_an_assistant_turn_keeps_its_thinking_and_a_last_one_is_a_prefill():
    chat = parse({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Yo"}]},
        {"role": "user", "content": "go on"}, {"role": "assistant", "content": "Once"}]}).chat()
    assert [m.for_template() for m in chat.messages] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Yo", "reasoning_content": "hm"},
        {"role": "user", "content": "go on"}, {"role": "assistant", "content": "Once"}]
    assert chat.continue_final_message and not chat.add_generation_prompt


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages.0.content.1.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                 "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "a",
                                                      "name": "f", "input": {}}]}]},
     "messages.1.content"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"system": [{"type": "image", "source": {}}]}, "system.0.type"),
    ({"tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"}]}, "tools.1.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]},
     "mcp_servers"),
    ({"container": "c1"}, "container"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"thinking_token_budget": 5}, "thinking_token_budget"),
])
def test_refusals_name_their_param(body, param):
    with pytest.raises(APIError) as info:
        parse({"messages": [{"role": "user", "content": "hi"}], **body}).chat()
    assert (info.value.status, info.value.param) == (400, param)


def test_a_message_the_server_cut_short_has_no_stop_reason(tokenizer):
    """finish_reason "abort" (draining): Anthropic's reasons do not cover it."""
    choice = Choice(0, 0, TextStream(tokenizer), [1, 2], None)
    choice.consume(RequestUpdate(tokenizer.encode("ab", add_special_tokens=False), "abort"))
    body = MessageObject(MODEL).final(choice)
    assert (body["stop_reason"], body["content"]) == (None, [{"type": "text", "text": "ab"}])
    assert anthropic.types.Message.model_validate(body).content[0].text == "ab"


def test_a_message_cut_at_the_context_and_an_empty_one(tokenizer):
    """A max_tokens cut to the context's rest ends with Anthropic's
    model_context_window_exceeded; an answer with nothing has one empty text block (as
    vLLM's), streamed too."""
    choice = Choice(0, 0, TextStream(tokenizer), [1, 2], None)
    choice.consume(RequestUpdate([65, 66], "length"))
    assert MessageObject(MODEL, max_tokens=2).final(choice)["stop_reason"] == "max_tokens"
    assert MessageObject(MODEL, max_tokens=9).final(choice)["stop_reason"] == \
        "model_context_window_exceeded"
    empty = Choice(0, 0, TextStream(tokenizer), [1, 2], None)
    writer = MessageEvents(MessageObject(MODEL))
    events = writer.start({"": empty})
    events += writer.update(empty, empty.consume(RequestUpdate([], "stop")))
    events += asyncio.run(writer.finish({"": empty}))
    assert [e["event"] for e in events] == ["message_start", "content_block_start",
                                            "content_block_stop", "message_delta",
                                            "message_stop"]
    body = writer.message.final(empty)
    assert (body["content"], body["stop_reason"]) == ([{"type": "text", "text": ""}], "end_turn")


def test_usage_splits_the_prompt_into_cache_reads_writes_and_the_rest(tokenizer):
    choice = Choice(0, 0, TextStream(tokenizer), list(range(40)), None)
    choice.consume(RequestUpdate([65, 66], "length", num_cached_tokens=16))
    usage = MessageObject(MODEL, cache_block_size=16).usage(choice)
    # 40 prompt tokens: 16 found cached, the next full block (16) written, 8 neither
    assert usage == {"input_tokens": 8, "output_tokens": 2, "cache_creation_input_tokens": 16,
                     "cache_read_input_tokens": 16}
    assert MessageObject(MODEL).usage(choice)["input_tokens"] == 24  # no prefix caching


def test_streamed_events_are_valid_for_the_anthropic_client(tokenizer):
    """A choice that thinks, writes text and then a tool call, fed to the writer a few
    tokens at a time: every event validates as the client's own model of it, and the
    client's accumulator builds from them the non-streamed message."""
    from typing import get_args

    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent
    union = get_args(RawMessageStreamEvent)[0]  # Annotated[Union[...], discriminator]
    models = {get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(union)}
    text = 'Hmm, Rome.</think>Sure. <tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Rome"}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)

    def new_choice():
        return Choice(0, 0, TextStream(tokenizer), [1, 2, 3], None,
                      tools=ToolCallStream(make_parser("hermes")),
                      reasoning=ReasoningStream("deepseek_r1"))
    choice, message = new_choice(), MessageObject(MODEL)
    writer = MessageEvents(message)
    events = writer.start({"": choice})
    for start in range(0, len(ids), 3):
        is_last = start + 3 >= len(ids)
        delta = choice.consume(RequestUpdate(ids[start:start + 3], "stop" if is_last else None))
        events += writer.update(choice, delta)
    events += asyncio.run(writer.finish({"": choice})) + writer.done()
    data = [json.loads(e["data"]) for e in events]
    assert [d["type"] for d in data] == [e["event"] for e in events]
    snapshot, bufs = None, {}
    for d in data:
        snapshot = accumulate_event(event=models[d["type"]].model_validate(d),
                                    current_snapshot=snapshot, json_bufs=bufs)
    final = message.final(choice)
    assert snapshot.to_dict(exclude_none=True) == \
        anthropic.types.Message.model_validate(final).to_dict(exclude_none=True)
    thinking, answer, call = final["content"]
    assert (thinking["thinking"], answer["text"]) == ("Hmm, Rome.", "Sure.")
    assert (call["name"], call["input"], final["stop_reason"]) == \
        ("get_weather", {"city": "Rome"}, "tool_use")
    assert call["id"].startswith("toolu_") and data[-1]["type"] == "message_stop"


def test_a_tool_round_trip_renders_as_the_chat_template(tokenizer):
    from deployments.frontend import Frontend
    from engine_actors.config import EngineConfig
    frontend = Frontend(EngineConfig())
    frontend.tokenizer = tokenizer
    chat = parse({"messages": ROUND_TRIP, "system": "Be brief.", "tools": [TOOL]}).chat()
    ids = asyncio.run(frontend.chat_ids(chat.messages, chat.tools))
    assert ids == template_ids(tokenizer, ROUND_TRIP_CHAT, tools=[WEATHER],
                               add_generation_prompt=True)
    count = parse({"messages": ROUND_TRIP}, CountTokensRequest)
    assert count.to_chat().max_tokens is None  # (count_tokens takes no max_tokens)


# ---- over HTTP -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def test_greedy_text_equals_transformers_and_max_tokens_cuts_it(claude, tokenizer):
    res = claude.messages.create(model=MODEL, max_tokens=12, system="Be brief.",
                                 messages=ROUND_TRIP[:1], extra_body={"temperature": 0, **NO_EOS})
    prompt = template_ids(tokenizer, ROUND_TRIP_CHAT[:2], add_generation_prompt=True)
    ref = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 12)
    assert res.content[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert (res.stop_reason, res.stop_sequence, res.role, res.model) == \
        ("max_tokens", None, "assistant", MODEL)
    usage = res.usage
    assert usage.output_tokens == 12 and usage.input_tokens + (
        usage.cache_read_input_tokens + usage.cache_creation_input_tokens) == len(prompt)
    assert res.id.startswith("msg_") and res.type == "message"
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.",
                                         messages=ROUND_TRIP[:1])
    assert count.input_tokens == len(prompt)


def test_streamed_deltas_join_to_the_non_streamed_text_and_stop_sequences_end_it(claude, url):
    kwargs = dict(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Tell me"}],
                  extra_body={"temperature": 0, **NO_EOS})
    full = claude.messages.create(**kwargs).content[0].text
    events = list(claude.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 5 and "".join(deltas) == full
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 30
    stop = full[10:13]
    assert stop and stop not in full[:10]
    with claude.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == full[:full.index(stop)]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    wait_idle(url)


def test_a_last_assistant_message_is_continued(claude, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    res = claude.messages.create(model=MODEL, max_tokens=6, messages=messages,
                                 extra_body={"temperature": 0, **NO_EOS})
    prompt = template_ids(tokenizer, messages, continue_final_message=True)
    ref = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 6)
    assert res.content[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def test_output_config_format_gives_json_that_validates(claude):
    for seed in range(2):
        res = claude.messages.create(
            model=MODEL, max_tokens=400, messages=[{"role": "user", "content": f"p {seed}"}],
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            extra_body={"seed": seed, "temperature": 1.0})
        assert res.stop_reason == "end_turn"
        jsonschema.validate(json.loads(res.content[0].text), SCHEMA)


@pytest.mark.parametrize("tool_choice", [{"type": "any"},
                                         {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_call_is_a_tool_use_block(claude, url, tool_choice):
    kwargs = dict(model=MODEL, max_tokens=200, tools=[TOOL],
                  messages=[{"role": "user", "content": "weather in Rome?"}],
                  tool_choice={**tool_choice, "disable_parallel_tool_use": True},
                  extra_body={"seed": 1, "temperature": 1.0})
    res = claude.messages.create(**kwargs)
    calls = [b for b in res.content if b.type == "tool_use"]
    assert res.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, TOOL["input_schema"])
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1
    jsonschema.validate(streamed[0].input, TOOL["input_schema"])
    wait_idle(url)


def test_a_tool_round_trip_is_served(claude, tokenizer):
    res = claude.messages.create(model=MODEL, max_tokens=3, system="Be brief.",
                                 messages=ROUND_TRIP, tools=[TOOL], tool_choice={"type": "none"})
    expected = template_ids(tokenizer, ROUND_TRIP_CHAT, tools=[WEATHER],
                            add_generation_prompt=True)
    usage = res.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + \
        usage.cache_creation_input_tokens == len(expected)


def test_errors_have_anthropics_shape(claude, url):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    for body, words in [({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
                        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                            {"type": "image", "source": {}}]}]}, "image"),
                        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 5000}]},
                         "prompt is too long: 50"),  # (Anthropic's words: Claude Code compacts)
                        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                          "output_config": {"format": {"type": "json_schema",
                                                       "schema": {"type": "objectx"}}}},
                         "output_config.format")]:
        r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert words in r.json()["error"]["message"], r.text
        assert "response_format" not in r.json()["error"]["message"]  # (the chat route's)
    r = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_missed_deadline_is_408_or_an_error_event(claude, url):
    body = {"model": MODEL, "max_tokens": 4, "deadline_ms": 0.001,
            "messages": [{"role": "user", "content": "late"}]}
    r = httpx.post(f"{url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout_error"
    assert r.headers["x-should-retry"] == "false"  # (the SDK would retry a 408)
    with pytest.raises(anthropic.APIStatusError) as e:  # the SDK raises the error event
        list(claude.messages.create(stream=True, model=MODEL, max_tokens=4,
                                    messages=body["messages"],
                                    extra_body={"deadline_ms": 0.001}))
    assert "deadline" in str(e.value)


def test_the_api_key_may_come_as_x_api_key():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from deployments.auth import APIKeyMiddleware
    app = APIKeyMiddleware(Starlette(routes=[
        Route("/v1/messages", lambda r: PlainTextResponse("ok"), methods=["POST"]),
        Route("/v1/models", lambda r: PlainTextResponse("ok"))]), "k1")

    async def status(method, path, headers) -> tuple[int, dict | None]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://x") as client:
            r = await client.request(method, path, headers=headers)
            return r.status_code, (r.json() if r.status_code != 200 else None)

    for headers in [{"x-api-key": "k1"}, {"Authorization": "Bearer k1"}]:
        assert asyncio.run(status("POST", "/v1/messages", headers))[0] == 200
    for headers in [{"x-api-key": "k2"}, {"x-api-key": "Bearer k1"}, {}]:
        code, body = asyncio.run(status("POST", "/v1/messages", headers))
        assert code == 401 and body["error"]["type"] == "authentication_error"
        assert body["type"] == "error"  # (Anthropic's shape on its routes)
    code, body = asyncio.run(status("GET", "/v1/models", {"x-api-key": "nope"}))
    assert code == 401 and body["error"]["code"] == "invalid_api_key"  # (OpenAI's)
