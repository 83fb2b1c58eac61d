"""Structured output and tool calls over HTTP on the random-weight model: whatever it
samples, the output follows the schema, regex, choice or tool signature (xgrammar masks)."""
from __future__ import annotations

import json
import re

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")

from engine_actors.checkpoint import load_tokenizer, resolve_model_path  # noqa: E402
from engine_actors.config import DEFAULT_MODEL  # noqa: E402
from engine_actors.request import SamplingParams  # noqa: E402
from tests.engine_harness import InProcessEngine  # noqa: E402
from tests.serve_fixture import wait_idle  # noqa: E402

MODEL = "tiny-random-llama"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer"},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                   "zip": {"type": "integer"}},
                    "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]},
                 "maxItems": 3},
        "active": {"type": "boolean"},
        # a length limit: xgrammar 0.2.8 let control characters into such strings
        "nick": {"type": "string", "minLength": 1, "maxLength": 6},
    },
    "required": ["name", "age", "address", "tags", "nick"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer"}, "unit": {"type": "string", "maxLength": 4}},
        "required": ["city", "days", "unit"],
        "additionalProperties": False}}}


def test_json_schema_outputs_always_validate(url):
    """20 sampled requests at temperature 1, chat and completions mixed, in one batch."""
    import asyncio

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            calls = []
            for i in range(20):
                common = {"max_tokens": 400, "temperature": 1.0, "seed": i,
                          "response_format": fmt}
                if i % 2:
                    calls.append(http.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"person {i}"}], **common}))
                else:
                    calls.append(http.post("/v1/completions", json={"prompt": f"p{i}", **common}))
            return await asyncio.gather(*calls)

    for r in asyncio.run(run()):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_choice_and_regex(url):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "json please"}], "max_tokens": 1500,
        "temperature": 0.0, "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    for seed in range(4):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "pick", "max_tokens": 20, "temperature": 1.0, "seed": seed,
            "guided_choice": ["yes", "no", "maybe later"]})
        assert r.json()["choices"][0]["text"] in {"yes", "no", "maybe later"}
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "date", "max_tokens": 30, "temperature": 1.0, "seed": seed,
            "guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"})
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]",
                            r.json()["choices"][0]["text"])


GRAMMAR = 'root ::= "(" num (("+" | "*") num)* ")"\nnum ::= [1-9] [0-9]?'


@pytest.mark.parametrize("fields,check", [
    ({"guided_grammar": GRAMMAR}, r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "yes|no"),
    ({"structured_outputs": {"regex": "[a-c]{3}x"}}, "[a-c]{3}x"),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"},
                                      "maxItems": 3}}}, None),
    ({"structured_outputs": {"json_object": True}}, "{.*")])
def test_vllm_structured_outputs_and_guided_grammar(url, fields, check):
    """vLLM's structured_outputs (its newer form of the guided_* fields) and an EBNF
    grammar: both used to be ignored, the output unconstrained."""
    for seed in range(3):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "go", "max_tokens": 60, "temperature": 1.0, "seed": seed, **fields})
        choice = r.json()["choices"][0]
        if check is None:
            assert choice["finish_reason"] == "stop", choice
            assert all(isinstance(i, int) for i in json.loads(choice["text"]))
        else:  # (any JSON object: random strings may not end within max_tokens)
            assert choice["finish_reason"] == "stop" or check == "{.*", choice
            assert re.fullmatch(check, choice["text"], re.DOTALL), choice["text"]


@pytest.mark.parametrize("field,value,param", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                               "schema": {"type": "objectx"}}},
     "response_format"),
    ("guided_regex", "(unclosed", "guided_regex"),
    ("response_format", {"type": "json_schema"}, "response_format.json_schema"),
    # grammars that match no text: their mask would allow no token
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x",
                                                               "schema": {"$ref": "#"}}},
     "response_format"),
    ("guided_regex", "[^\\x00-\\U0010FFFF]", "guided_regex"),
    ("guided_grammar", "root ::= missing_rule", "guided_grammar"),
    ("structured_outputs", {"grammar": 'root ::= [^\\x00-\\U0010FFFF]'},
     "structured_outputs.grammar"),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs.choice"),
    # structural tags: neither form, a format xgrammar does not know, a tag no trigger starts
    ("structured_outputs", {"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ("structured_outputs", {"structural_tag": "{"}, "structured_outputs.structural_tag"),
    ("response_format", {"type": "structural_tag"}, "response_format"),
    ("response_format", {"type": "structural_tag", "format": {"type": "nope"}},
     "response_format"),
    ("response_format", {"type": "structural_tag", "triggers": ["<b"], "structures": [
        {"begin": "<a>", "schema": {}, "end": "</a>"}]}, "response_format"),
    ("response_format", {"type": "structural_tag", "format": {"type": "any_text"},
                         "triggers": ["<a"], "structures": []}, "response_format"),
    ("response_format", {"type": "json_object", "format": {"type": "any_text"}},
     "response_format"),
    ("structured_outputs", {"structural_tag": '{"format": ' * 900 + "1" + "}" * 900},
     "structured_outputs.structural_tag"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(url, field, value, param):
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "x"}], field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


TAG = {"type": "tag", "begin": "<r>", "end": "</r>", "content": {
    "type": "json_schema", "json_schema": {"type": "string", "enum": ["ab", "cd"]}}}


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "structural_tag", "format": TAG}},
    {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag",
                                                          "format": TAG})}}])
def test_a_structural_tag_shapes_the_whole_output(url, fields):
    """vLLM's structural tag (xgrammar's format): here a tag around a JSON value."""
    for seed in range(3):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "go", "max_tokens": 40, "temperature": 1.0, "seed": seed, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert re.fullmatch(r'<r>\s*"(ab|cd)"\s*</r>', choice["text"]), choice


def test_older_structural_tags_start_where_a_trigger_appears(url):
    """vLLM's older form: free text, in which a trigger starts the structure that begins
    with it. A bias makes the model write the trigger "<" whenever it may: each time the
    tag and its JSON follow (unmasked, it would write "<<<<...")."""
    lt = httpx.post(f"{url}/tokenize", json={"prompt": "<", "add_special_tokens": False},
                    timeout=30).json()["tokens"]
    fmt = {"type": "structural_tag", "triggers": ["<"], "structures": [
        {"begin": "<r>", "schema": {"type": "boolean"}, "end": "</r>"}]}
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "tags"}], "max_tokens": 40,
        "temperature": 1.0, "seed": 0, "logit_bias": {str(lt[0]): 100},
        "response_format": fmt})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert len(lt) == 1 and text.startswith("<r>"), text
    whole = text[:text.rfind("</r>") + 4]  # (max_tokens may cut the last tag short)
    assert re.fullmatch(r"(<r>\s*(true|false)\s*</r>)+", whole), text
    rest = text[len(whole):].replace(" ", "")
    assert any(tag.startswith(rest) for tag in ("<r>true</r>", "<r>false</r>")), text


def test_required_and_named_tool_calls_streamed_or_not(url):
    check_forced_calls(url, rounds=2)
    wait_idle(url)


def check_forced_calls(url: str, rounds: int, tool: dict = WEATHER) -> list[dict]:
    """tool_choice "required" and named, `rounds` times each, then "required" streamed:
    each answer is one valid call of `tool`. Returns the streamed deltas."""
    # one call: a random-weight model would go on calling (parallel calls' grammar:
    # test_forced_calls_are_one_or_more_only_with_parallel_tool_calls)
    name = tool["function"]["name"]
    body = {"messages": [{"role": "user", "content": "weather in Rome?"}], "max_tokens": 200,
            "temperature": 1.0, "tools": [tool], "parallel_tool_calls": False}
    for seed, choice in enumerate(["required", {"type": "function",
                                                "function": {"name": name}}] * rounds):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={**body, "tool_choice": choice, "seed": seed})
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        assert out["message"]["content"] is None, out
        call = out["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == name
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tool["function"]["parameters"])
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={**body, "tool_choice": "required", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == name
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    return deltas


def test_tool_messages_and_none_go_through_the_template(url):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": messages, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] != "tool_calls"
    assert r.json()["usage"]["prompt_tokens"] > 100  # the call and the tool answer included


def test_langchain_bind_tools_and_structured_output(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(json_schema_extra={"enum": ["ann", "bob"]})
        age: int

    llm = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=MODEL,
                                      max_tokens=200, temperature=1.0, max_retries=0)
    message = llm.bind_tools([WEATHER], tool_choice="required",
                             parallel_tool_calls=False).invoke("weather in Oslo?")
    call = message.tool_calls[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    person = llm.with_structured_output(Person).invoke("make up a person")
    assert isinstance(person, Person) and person.name in {"ann", "bob"}


@pytest.mark.parametrize("engine_args", [dict(async_scheduling=True),
                                         dict(scheduling_policy="priority", max_num_tokens=200)])
def test_grammars_hold_across_overlap_chunks_and_preemption(engine_args):
    """In-process: overlapped steps (a grammar row's next step is scheduled before its token
    is known), chunked prefill, and preemption (matchers rebuilt from replayed tokens)."""
    import xgrammar as xgr
    spec = ("json_schema", json.dumps(SCHEMA))
    engine = InProcessEngine(model=DEFAULT_MODEL, max_batch_size=8, block_size=4,
                             max_num_batched_tokens=24, **engine_args)
    arrivals = {}
    for i in range(10):
        sampling = SamplingParams(max_tokens=150, temperature=1.0, seed=i,
                                  grammar=spec if i % 3 else None, ignore_eos=not i % 3)
        arrivals.setdefault(i % 4, []).append((f"r{i}", [7 + i] * (3 + 3 * i), sampling))
    outputs = engine.run(arrivals)
    if "max_num_tokens" in engine_args:
        assert engine.scheduler.num_preemptions > 0
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=258)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(spec[1])
    for reqs in arrivals.values():
        for rid, _, s in reqs:
            if s.grammar is None:
                assert len(outputs[rid]) == 150
                continue
            matcher = xgr.GrammarMatcher(compiled)
            assert all(matcher.accept_token(t) for t in outputs[rid]), rid
            assert matcher.is_terminated(), rid
            text = tokenizer.decode(outputs[rid], skip_special_tokens=True)
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kind", ["json_schema", "tool call"])
def test_a_string_with_a_length_limit_takes_only_what_json_allows(kind):
    """Each ASCII character alone as a limited string's value: the grammar accepts it only
    where json.loads takes the result (no raw control characters)."""
    import xgrammar as xgr

    from deployments.chat_protocol import Tool
    from deployments.structured import tool_grammar
    from engine_actors.grammar import Grammars
    params = {"type": "object", "properties": {"b": {"type": "string", "maxLength": 3}},
              "required": ["b"], "additionalProperties": False}
    if kind == "json_schema":
        spec, wrap = ("json_schema", json.dumps(params)), '{{"b": "{}"}}'
    else:
        tool = Tool.model_validate({"type": "function",
                                    "function": {"name": "f", "parameters": params}})
        spec = tool_grammar([tool], "required", "hermes")
        wrap = '<tool_call>\n{{"name": "f", "arguments": {{"b": "{}"}}}}\n</tool_call>'
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    grammars = Grammars(path, len(tokenizer))
    compiled = grammars._compile(spec)
    head, tail = (tokenizer.encode(part, add_special_tokens=False)
                  for part in wrap.format("\0").split("\0"))

    def takes(value: bytes) -> bool:  # the byte-level tokenizer's ids are the bytes
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in head + list(value) + tail) \
            and matcher.accept_token(tokenizer.eos_token_id)
    accepted = [code for code in range(128) if takes(bytes([code]))]
    for code in accepted:
        text = wrap.format(chr(code))
        json.loads(text if kind == "json_schema" else text.split("\n")[1])  # strict
    assert set(range(32, 127)) - {ord('"'), ord("\\")} <= set(accepted)
    assert not set(range(32)) & set(accepted)
    # UTF-8: a two-byte letter is one character; an encoded surrogate is not text
    assert takes("Ś".encode()) and not takes(b"\xed\xa0\x80")


def grammar_takes():
    """takes(spec, text): does the grammar of `spec` accept the whole text, then the end
    (the built-in model's tokenizer)?"""
    import xgrammar as xgr

    from engine_actors.grammar import Grammars
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    grammars = Grammars(path, len(tokenizer))

    def takes(spec, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammars._compile(spec))
        return all(matcher.accept_token(t)
                   for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.accept_token(tokenizer.eos_token_id)
    return takes


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_forced_calls_are_one_or_more_only_with_parallel_tool_calls(parser):
    """tool_choice "required": two calls in a row are accepted with parallel_tool_calls
    (the default), only one without; a named function is always one call; nothing else."""
    from deployments.chat_protocol import NamedToolChoice, Tool
    from deployments.structured import tool_grammar
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}})]
    weather = {"city": "Rome", "days": 2, "unit": "C"}
    if parser == "hermes":
        calls = ['<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(weather)
                 + '}\n</tool_call>', '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>']
        separator = "\n"
    else:
        calls = ['{"name": "get_weather", "parameters": ' + json.dumps(weather) + "}",
                 '{"name": "now", "parameters": {}}']
        separator = "; "
    takes = grammar_takes()
    jsonschema.validate(weather, WEATHER["function"]["parameters"])
    parallel = tool_grammar(tools, "required", parser)
    single = tool_grammar(tools, "required", parser, parallel=False)
    named = tool_grammar(tools, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "now"}}), parser)
    two = calls[0] + separator + calls[1]
    assert takes(parallel, calls[0]) and takes(parallel, two)
    assert takes(single, calls[0]) and takes(single, calls[1]) and not takes(single, two)
    assert takes(named, calls[1]) and not takes(named, calls[0]) and not takes(named, two)
    assert not takes(parallel, "") and not takes(parallel, "hi " + calls[0])
