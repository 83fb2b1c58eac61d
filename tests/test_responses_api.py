"""POST /v1/responses: request conversion and refusals (no server), the streamed events
against the openai client's own event models, and over real HTTP with the official client:
greedy text equal to transformers', streaming, structured output, forced tool calls, and a
function-call round trip rendered as the chat template renders the equivalent messages."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai")  # a test extra; absent on the GPU machine's image
jsonschema = pytest.importorskip("jsonschema")

from deployments.protocol import APIError  # noqa: E402
from deployments.request_body import parse_body  # noqa: E402
from deployments.choice import Choice  # noqa: E402
from deployments.response_output import ResponseEvents, ResponseObject  # noqa: E402
from deployments.responses_items import normalize_input  # noqa: E402
from deployments.responses_protocol import ResponsesRequest  # noqa: E402
from deployments.tool_parsers import ToolCallStream, make_parser  # noqa: E402
from engine_actors.checkpoint import resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from engine_actors.detokenizer import TextStream  # noqa: E402
from engine_actors.messages import RequestUpdate  # noqa: E402
from tests.engine_harness import hf_greedy  # noqa: E402
from tests.serve_fixture import wait_idle  # noqa: E402
from tests.test_structured_output import SCHEMA, WEATHER  # noqa: E402

MODEL = "tiny-random-llama"
NO_EOS = {"ignore_eos": True}
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses shape: one level less
ROUND_TRIP = [
    {"role": "user", "content": "weather in Oslo?"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Oslo\", \"days\": 2, \"unit\": \"C\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 12 C"},
    {"role": "user", "content": [{"type": "input_text", "text": "and "},
                                 {"type": "input_text", "text": "tomorrow?"}]}]
# the same conversation as chat messages, as a chat template takes them
ROUND_TRIP_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather",
                     "arguments": {"city": "Oslo", "days": 2, "unit": "C"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 12 C"},
    {"role": "user", "content": "and tomorrow?"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))


def parse(body: dict) -> ResponsesRequest:
    return parse_body(json.dumps(body).encode(), ResponsesRequest)


def to_chat(body: dict):
    """The chat request of a Responses body that references no stored response."""
    req = parse(body)
    return req.to_chat(normalize_input(req.input))


# ---- without a server ----------------------------------------------------------------------
def test_input_items_become_chat_messages():
    chat = to_chat({"input": ROUND_TRIP, "instructions": "Be brief.", "tools": [TOOL],
                  "tool_choice": {"type": "function", "name": "get_weather"},
                  "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                  "top_k": 5, "stop": ["x"], "priority": 2,
                  "text": {"format": {"type": "json_schema", "name": "p",
                                      "schema": SCHEMA}}})
    assert [m.for_template() for m in chat.messages] == ROUND_TRIP_CHAT
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [WEATHER]
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.json_schema.schema_ == SCHEMA
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed, chat.top_k, chat.stop,
            chat.priority) == (7, 0.5, 0.9, 3, 5, ["x"], 2)
    assert [m.for_template() for m in to_chat({"input": "hi"}).messages] == \
        [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param", [
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"conversation": {"name": "conv_1"}}, "conversation"),
    ({"background": True, "store": False}, "background"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input.0.content.1"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "computer_call", "id": "c"}]},
     "input.1.type"),
    ({"input": [{"type": "reasoning", "content": [{"type": "output_text", "text": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference"}]}, "input.0.id"),
    ({"tools": [TOOL, {"type": "web_search"}]}, "tools.1.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"tools": [TOOL], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input.0"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input.0.content.0"),
    ({"tools": ["get_weather"]}, "tools.0"),
    ({"tool_choice": ["auto"], "tools": [TOOL]}, "tool_choice"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),  # (OpenAI's: keys of 64 at most)
])
def test_refusals_name_their_param(body, param):
    with pytest.raises(APIError) as info:
        to_chat({"input": "hi", **body})
    assert (info.value.status, info.value.param) == (400, param)


def test_unknown_fields_are_ignored():
    body = {"input": "hi", "store": True, "reasoning": {"effort": "low"}, "include": ["x"],
            "parallel_tool_calls": False, "metadata": {"k": "v"}}
    assert to_chat(body).parallel_tool_calls is False and parse(body).metadata == {"k": "v"}
    assert to_chat(body).max_tool_calls() == 1
    assert to_chat({"input": "hi", "max_tool_calls": 3}).max_tool_calls() == 3
    assert to_chat({"input": "hi"}).max_tool_calls() is None


def test_a_request_the_server_cut_short_is_incomplete_with_no_reason(tokenizer):
    """finish_reason "abort" (draining): OpenAI's reasons do not cover it."""
    from openai.types.responses import Response
    choice = Choice(0, 0, TextStream(tokenizer), [1, 2], None)
    choice.consume(RequestUpdate(tokenizer.encode("ab", add_special_tokens=False), "abort"))
    body = ResponseObject(parse({"input": "hi"}), MODEL, 1.0, 1.0).final(choice)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": None}
    assert Response.model_validate(body).output_text == "ab"


def test_streamed_events_are_valid_for_the_openai_client(tokenizer):
    """A choice that writes text and then a tool call, fed to the writer a few tokens at a
    time: every event validates as the client's own model of it, sequence numbers count
    up from 0, and the deltas join to the final response's items."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent
    union = get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], discriminator]
    models = {get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(union)}
    req = parse({"input": "hi", "tools": [TOOL]})
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n' \
           '</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    choice = Choice(0, 0, TextStream(tokenizer), [1, 2, 3], None,
                    tools=ToolCallStream(make_parser("hermes")))
    writer = ResponseEvents(ResponseObject(req, MODEL, 1.0, 1.0))
    events = writer.start({"": choice})
    for start in range(0, len(ids), 3):
        is_last = start + 3 >= len(ids)
        delta = choice.consume(RequestUpdate(ids[start:start + 3], "stop" if is_last else None))
        events += writer.update(choice, delta)
    events += asyncio.run(writer.finish({"": choice})) + writer.done()
    data = [json.loads(e["data"]) for e in events]
    assert [d["type"] for d in data] == [e["event"] for e in events]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    for d in data:
        models[d["type"]].model_validate(d)
    final = data[-1]["response"]
    assert data[-1]["type"] == "response.completed" and final["status"] == "completed"
    message, call = final["output"]
    deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert deltas == message["content"][0]["text"] == "Sure."
    args = [d["arguments"] for d in data if d["type"] == "response.function_call_arguments.done"]
    assert args == [call["arguments"]] and json.loads(call["arguments"]) == {"city": "Rome"}
    assert call["call_id"].startswith("call_") and call["name"] == "get_weather"


def test_a_function_call_round_trip_renders_as_the_chat_template(tokenizer):
    from deployments.frontend import Frontend
    from engine_actors.config import EngineConfig
    frontend = Frontend(EngineConfig())
    frontend.tokenizer = tokenizer
    chat = to_chat({"input": ROUND_TRIP, "instructions": "Be brief.", "tools": [TOOL]})
    ids = asyncio.run(frontend.chat_ids(chat.messages, chat.tools))
    expected = tokenizer.apply_chat_template(ROUND_TRIP_CHAT, tools=[WEATHER],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert ids == list(expected)
    assert "sunny, 12 C" in tokenizer.decode(ids) and "get_weather" in tokenizer.decode(ids)


# ---- over HTTP -----------------------------------------------------------------------------
def test_greedy_text_equals_transformers_and_max_output_tokens_cuts_it(client, tokenizer):
    res = client.responses.create(model=MODEL, input=ROUND_TRIP[:2] + ROUND_TRIP[4:],
                                  instructions="Be brief.", max_output_tokens=12, temperature=0,
                                  metadata={"run": "1"}, store=True, extra_body=NO_EOS)
    messages = [ROUND_TRIP_CHAT[0], ROUND_TRIP_CHAT[1],
                {"role": "assistant", "content": "Let me look."}, ROUND_TRIP_CHAT[4]]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    ref = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 12)
    assert res.output_text == tokenizer.decode(ref, skip_special_tokens=True)
    assert res.status == "incomplete" and res.incomplete_details.reason == "max_output_tokens"
    assert (res.usage.input_tokens, res.usage.output_tokens) == (len(prompt), 12)
    assert res.usage.total_tokens == len(prompt) + 12
    assert res.id.startswith("resp_") and res.object == "response" and res.model == MODEL
    assert res.output[0].type == "message" and res.output[0].id.startswith("msg_")
    assert (res.instructions, res.max_output_tokens, res.temperature, res.store,
            res.metadata, res.error) == ("Be brief.", 12, 0, True, {"run": "1"}, None)


def test_streamed_deltas_join_to_the_non_streamed_text(client, url):
    kwargs = dict(model=MODEL, input="Tell me a story", max_output_tokens=30, temperature=0,
                  extra_body=NO_EOS)
    full = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 5 and "".join(deltas) == full.output_text
    assert events[-1].response.output_text == full.output_text
    assert events[-1].response.usage.output_tokens == 30
    # the client's stream helper, on a response that completes (a stop string ends it)
    stop = full.output_text[10:13]
    assert stop and stop not in full.output_text[:10]
    with client.responses.stream(model=MODEL, input="Tell me a story", temperature=0,
                                 max_output_tokens=30, extra_body={**NO_EOS, "stop": [stop]}
                                 ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == full.output_text[:full.output_text.index(stop)]
    assert final.status == "completed"
    wait_idle(url)


def test_logprobs_equal_transformers_streamed_or_not(client, tokenizer):
    from tests.test_logits import hf_logprobs
    kwargs = dict(model=MODEL, input="hi", max_output_tokens=5, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"], extra_body=NO_EOS)
    res = client.responses.create(**kwargs)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False))
    generated = hf_greedy(resolve_model_path(DEFAULT_MODEL), prompt, 5)
    ref = hf_logprobs(prompt + generated)
    entries = res.output[0].content[0].logprobs
    assert [e.token for e in entries] == [tokenizer.decode([t]) for t in generated]
    for t, entry in enumerate(entries):
        row = ref[len(prompt) - 1 + t]
        assert entry.logprob == pytest.approx(row[generated[t]].item(), abs=1e-4)
        assert [x.logprob for x in entry.top_logprobs] == \
            pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    assert res.top_logprobs == 2
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert events[-1].response.output[0].content[0].logprobs == entries
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


def test_json_schema_format_gives_json_that_validates(client):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    for seed in range(3):
        res = client.responses.create(model=MODEL, input=f"person {seed}", temperature=1.0,
                                      max_output_tokens=400, text={"format": fmt},
                                      extra_body={"seed": seed})
        assert res.status == "completed"
        jsonschema.validate(json.loads(res.output_text), SCHEMA)
        assert res.text.format.type == "json_schema"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "name": "get_weather"}])
def test_a_forced_tool_call_is_a_function_call_item(client, url, tool_choice):
    # one call: a random-weight model would go on calling (test_structured_output tests
    # parallel calls' grammar)
    kwargs = dict(model=MODEL, input="weather in Rome?", tools=[TOOL], tool_choice=tool_choice,
                  temperature=1.0, max_output_tokens=200, parallel_tool_calls=False,
                  extra_body={"seed": 1})
    res = client.responses.create(**kwargs)
    calls = [item for item in res.output if item.type == "function_call"]
    assert res.status == "completed" and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    assert res.tools[0].name == "get_weather"
    events = list(client.responses.create(stream=True, **kwargs))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and len(done) == 1
    assert done[0].arguments == [i for i in final.output if i.type == "function_call"][0].arguments
    jsonschema.validate(json.loads(done[0].arguments), TOOL["parameters"])
    wait_idle(url)


def test_a_function_call_round_trip_is_served(client, tokenizer):
    res = client.responses.create(model=MODEL, input=ROUND_TRIP, instructions="Be brief.",
                                  tools=[TOOL], tool_choice="none", max_output_tokens=3)
    expected = tokenizer.apply_chat_template(ROUND_TRIP_CHAT, tools=[WEATHER],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert res.usage.input_tokens == len(expected)  # "none": rendered, as vLLM (not parsed)


def test_truncation_auto_drops_as_few_first_turns_as_make_it_fit(client, url, tokenizer):
    """OpenAI's truncation "auto": a conversation over the context (4,096 tokens) loses its
    first turns, as few as make the prompt fit (here one; two would fit too), and keeps the
    instructions; "disabled" (the default) refuses it. A last turn that alone does not fit
    is refused either way."""
    long = "x" * 1500
    turns = [("user", long + "1"), ("assistant", long + "2"), ("user", long + "3"),
             ("assistant", "ok"), ("user", "and now?")]
    items = [{"role": role, "content": text} for role, text in turns]
    body = {"model": MODEL, "input": items, "instructions": "Be brief.",
            "max_output_tokens": 2, "temperature": 0}
    refused = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    res = client.responses.create(**body, truncation="auto")
    kept = [{"role": "system", "content": "Be brief."}] + items[2:]
    prompt = tokenizer.apply_chat_template(kept, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    assert res.usage.input_tokens == len(prompt) and res.truncation == "auto"
    assert res.status == "incomplete" and res.usage.output_tokens == 2
    alone = httpx.post(f"{url}/v1/responses", timeout=60, json={
        **body, "input": items[:2] + [{"role": "user", "content": "y" * 5000}],
        "truncation": "auto"})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "input", alone.text


def test_truncation_auto_keeps_an_agents_task_and_its_latest_calls(url):
    """An agent loop (one task, then calls and their outputs) over the context loses its
    oldest calls with their outputs, as few as fit (here two), never a call without its
    output; the developer message and the task stay: the prompt is the one the explicitly
    shortened input gives."""
    def group(k):
        return [{"type": "function_call", "call_id": f"call_{k}", "name": "get_weather",
                 "arguments": "{\"city\": \"Oslo\"}"},
                {"type": "function_call_output", "call_id": f"call_{k}", "output": "z" * 800}]
    head = [{"role": "developer", "content": "Use the tools."},
            {"role": "user", "content": "Plan a trip."}]
    groups = [item for k in range(5) for item in group(k)]  # (~1,040 tokens each)
    body = {"model": MODEL, "tools": [TOOL], "tool_choice": "none", "max_output_tokens": 2,
            "temperature": 0}

    def input_tokens(items, **extra):
        r = httpx.post(f"{url}/v1/responses", timeout=60, json={**body, "input": items, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]
    for dropped in (0, 1):  # whole, or without its first call: over the context
        assert httpx.post(f"{url}/v1/responses", timeout=60, json={
            **body, "input": head + groups[2 * dropped:]}).status_code == 400
    shortened = input_tokens(head + groups[4:])
    assert input_tokens(head + groups, truncation="auto") == shortened
    assert input_tokens(head + groups[8:]) < shortened  # (more would have fit)


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True, "store": False}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}},
     "text.format"),
    ({"input": "many words " * 5000}, "input"),
])
def test_refusals_over_http(url, body, param):
    r = httpx.post(f"{url}/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert "response_format" not in r.json()["error"]["message"]  # (the chat route's name)


def test_a_missed_deadline_is_408_or_a_failed_response(url):
    body = {"model": MODEL, "input": "late", "max_output_tokens": 4, "deadline_ms": 0.001}
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 408 and r.json()["error"]["code"] == "deadline_exceeded"
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True},
                      timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [line[7:] for line in lines if line.startswith("event: ")] == \
        [e["type"] for e in events]
    assert events[-1]["type"] == "response.failed" and "[DONE]" not in lines[-1]
    error = events[-1]["response"]["error"]
    assert error["code"] == "server_error" and "deadline" in error["message"]


def test_a_client_that_leaves_mid_stream_ends_the_request(url):
    before = wait_idle(url)
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
    after = wait_idle(url, timeout=30)
    assert after["num_steps"] - before["num_steps"] < 3000, (before, after)


def test_vllm_fields_reach_the_chat_request():
    chat = to_chat({"input": "hi", "cache_salt": "s", "skip_special_tokens": False,
                    "include_stop_str_in_output": True,
                    "structured_outputs": {"regex": "a+"}})
    assert (chat.cache_salt, chat.skip_special_tokens, chat.include_stop_str_in_output,
            chat.structured_outputs.regex) == ("s", False, True, "a+")
