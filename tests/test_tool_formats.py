"""The qwen3_coder, mistral, granite and pythonic tool-call formats: parsed whole and
streamed, forced by grammars, chosen from chat templates, and through HTTP (mistral)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

jsonschema = pytest.importorskip("jsonschema")

from deployments.chat_protocol import ChatCompletionRequest, NamedToolChoice, Tool  # noqa: E402
from deployments.protocol import APIError  # noqa: E402
from deployments.tool_parsers import ToolCall, ToolCallStream, make_parser  # noqa: E402
from tests.serve_fixture import wait_idle  # noqa: E402
from tests.test_structured_output import WEATHER, check_forced_calls  # noqa: E402
from tests.test_tool_parsers import MODES, WEATHER as PARIS, chunks  # noqa: E402

pytestmark = pytest.mark.own_server  # its own server (conftest runs these modules last)

TYPED = Tool.model_validate({"type": "function", "function": {
    "name": "book", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
        "late": {"type": "boolean"}, "rooms": {"type": "array"}, "guest": {"type": "object"},
        "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}}})


def run(parser_name: str, text: str, mode: str, tools=None):
    """(content, calls) as a client sees them (tests/test_tool_parsers.py's `run`, with the
    request's tools)."""
    if mode == "parse":
        return make_parser(parser_name, tools).parse(text)
    stream = ToolCallStream(make_parser(parser_name, tools))
    sent = "".join(stream.add(piece) for piece in chunks(text, mode))
    rest, calls = stream.finish()
    return (sent + (rest or "")) or None, calls


def qwen_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# ---- qwen3_coder --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_qwen3_coder_values_take_the_declared_types(mode):
    text = "I will book it.\n" + qwen_call(
        "book", city="Rome", nights="3", budget="99.5", late="true", rooms='["a", "b"]',
        guest='{"name": "Ann"}', note="null", code="007", extra="x\ny")
    content, calls = run("qwen3_coder", text, mode, [TYPED])
    assert content == "I will book it." and [c.name for c in calls] == ["book"]
    assert json.loads(calls[0].arguments) == {
        "city": "Rome", "nights": 3, "budget": 99.5, "late": True, "rooms": ["a", "b"],
        "guest": {"name": "Ann"}, "note": None, "code": "007", "extra": "x\ny"}


@pytest.mark.parametrize("mode", MODES)
def test_qwen3_coder_two_calls_and_values_that_are_not_their_type(mode):
    text = qwen_call("book", nights="three", budget="12") + "\n" + qwen_call("now")
    content, calls = run("qwen3_coder", text, mode, [TYPED])
    assert content is None
    assert calls == [ToolCall("book", '{"nights": "three", "budget": 12}'), ToolCall("now", "{}")]
    # without the request's tools every value is a string
    assert run("qwen3_coder", text, mode)[1][0].arguments == '{"nights": "three", "budget": "12"}'


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [
    "<tool_call>\n<function=book>\nhello\n<parameter=city>\nRome\n</parameter>\n</function>\n"
    "</tool_call>",  # text between parameters
    "<tool_call>\n{\"name\": \"book\"}\n</tool_call>",  # hermes' JSON is not this format
    "<tool_call>\n<function=book>\n<parameter=city>\nRome\n</parameter>\n</tool_call>"])
def test_qwen3_coder_malformed_call_is_content(mode, bad):
    good = qwen_call("now")
    assert run("qwen3_coder", bad + "\n" + good, mode) == (bad, [ToolCall("now", "{}")])


# ---- mistral ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", [
    # v3 tokenizers: one JSON array
    'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}}, '
    '{"name": "now", "arguments": {}}]',
    # v11: NAME[ARGS]{...} per call; v13 adds [CALL_ID]
    'Checking.[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]now[ARGS]{}',
    'Checking. [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS] {"location": "Paris"}'
    '[TOOL_CALLS]now[CALL_ID]f5g6h7i8j[ARGS]{}\n'])
def test_mistral_calls_in_each_tokenizer_version(mode, text):
    assert run("mistral", text, mode) == ("Checking.", [PARIS, ToolCall("now", "{}")])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris"}',  # cut
    '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS]get weather[ARGS]{}",
    '[TOOL_CALLS]now[ARGS]["x"]', "[TOOL_CALLS]now {}"])
def test_mistral_malformed_calls_are_content(mode, bad):
    assert run("mistral", "Hi. " + bad, mode) == ("Hi. " + bad, [])


def test_mistral_stream_sends_content_and_holds_a_partial_marker():
    stream = ToolCallStream(make_parser("mistral"))
    assert stream.add("It is [TOOL") == "It is"
    assert stream.add("S] done") == " [TOOLS] done"  # not the marker after all
    assert stream.finish() == (None, [])


# ---- granite ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text,content", [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"location": "Paris"}}]', None),
    (' [{"name": "get_weather", "arguments": {"location": "Paris"}}]\n', None),  # bare
    ('Sure.\n<|tool_call|>[{"name": "get_weather", "arguments": {"location": "Paris"}}]',
     "Sure.")])
def test_granite_calls(mode, text, content):
    assert run("granite", text, mode) == (content, [PARIS])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "arguments": {"location": "Paris"}}] and more', "[1] See notes.",
    '<|tool_call|>[{"name": "get_weather", "arguments": "Paris"}]'])
def test_granite_anything_else_is_content(mode, text):
    assert run("granite", text, mode) == (text, [])


# ---- pythonic -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_pythonic_calls_with_literal_arguments(mode):
    text = ' [get_weather(location="Paris"), book(nights=3, late=True, rooms=["a", (1, 2)], ' \
           "guest={'n': None}, budget=-1.5), now()]\n"
    assert run("pythonic", text, mode) == (None, [PARIS, ToolCall(
        "book", '{"nights": 3, "late": true, "rooms": ["a", [1, 2]], "guest": {"n": null}, '
                '"budget": -1.5}'), ToolCall("now", "{}")])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", [
    'get_weather(location="Paris")', '[get_weather("Paris")]', "[f(x=g())]", "[f(**kw)]",
    "[f(x={1, 2})]", "[a.b(x=1)]", "[]", "[1, 2]", "[f(x=1)] then", "It is [f(x=1)]"])
def test_pythonic_anything_else_is_content(mode, text):
    assert run("pythonic", text, mode) == (text, [])


# ---- what the server picks and does -------------------------------------------------------
@pytest.mark.parametrize("template,architecture,parser", [
    ("{{ '<tool_call>\\n<function=' }}", "Qwen3MoeForCausalLM", "qwen3_coder"),
    ("{{ '<tool_call>' }}", "Qwen3ForCausalLM", "hermes"),
    ("{{ '[TOOL_CALLS]' }}", "MistralForCausalLM", "mistral"),
    ("{{ '<|tool_call|>' }}", "GraniteForCausalLM", "granite"),
    ("{{ messages }}", "LlamaForCausalLM", "llama3_json")])
def test_the_format_comes_from_the_chat_template(template, architecture, parser):
    from deployments.structured import default_tool_parser
    assert default_tool_parser(SimpleNamespace(chat_template=template), architecture) == parser


@pytest.mark.parametrize("parser,calls", [
    ("qwen3_coder", [qwen_call("get_weather", city="Rome", days="2", unit="C"),
                     "<tool_call>\n<function=now>\n\n</function>\n</tool_call>"]),
    ("mistral", ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", '
                 '"days": 2, "unit": "C"}}]', '[TOOL_CALLS][{"name": "now", "arguments": {}}]']),
    ("granite", ['<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome", '
                 '"days": 2, "unit": "C"}}]', '<|tool_call|>[{"name": "now", "arguments": {}}]'])])
def test_forced_calls_follow_each_format_and_parse_back(parser, calls):
    """tool_choice "required" (one or more calls with parallel_tool_calls) and a named
    function: the grammar takes the format's calls, and the parser reads them back."""
    from deployments.structured import tool_grammar
    from deployments.tool_parsers import CALL_SEPARATORS
    from tests.test_structured_output import grammar_takes
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}})]
    takes = grammar_takes()
    two = calls[0] + CALL_SEPARATORS[parser] + calls[1]
    parallel = tool_grammar(tools, "required", parser)
    named = tool_grammar(tools, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "now"}}), parser)
    assert takes(parallel, calls[0]) and takes(parallel, two)
    assert takes(named, calls[1]) and not takes(named, calls[0]) and not takes(named, two)
    assert not takes(parallel, "hi " + calls[0])
    bad = calls[0].replace('"days": 2', '"days": "2"').replace("2\n</param", "two\n</param")
    assert bad != calls[0] and not takes(parallel, bad)
    assert make_parser(parser, tools).parse(two) == (None, [
        ToolCall("get_weather", '{"city": "Rome", "days": 2, "unit": "C"}'),
        ToolCall("now", "{}")])


def test_forced_pythonic_calls_take_each_parameters_type_and_parse_back():
    """tool_choice "required" (one or more calls) and a named function: keyword arguments
    in the schema's order, the required ones always, the optional ones or not, each value
    a Python literal of its type; what the grammar takes, the parser reads."""
    from deployments.structured import tool_grammar
    from tests.test_structured_output import grammar_takes
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["query"], "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "exact": {"type": "boolean"}, "filters": {"type": "object"}, "extra": {}}}}}
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(search)]
    takes = grammar_takes()
    parallel = tool_grammar(tools, "required", "pythonic")
    named = tool_grammar(tools, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "search"}}), "pythonic")
    weather = "get_weather(city='Rome', days=2, unit=\"C\")"
    full = "search(query='it\\'s', limit=-3, tags=['a', \"b\"], exact=True, " \
           "filters={'k': [1, None]}, extra=2.5e-3)"
    for text, names in ((f"[{weather}]", ["get_weather"]),
                        (f"[{weather}, {full}]", ["get_weather", "search"]),
                        ("[search(query='x', exact=False)]", ["search"])):
        assert takes(parallel, text), text
        assert [c.name for c in make_parser("pythonic").parse(text)[1]] == names
    assert make_parser("pythonic").parse(f"[{full}]")[1] == [ToolCall("search", json.dumps(
        {"query": "it's", "limit": -3, "tags": ["a", "b"], "exact": True,
         "filters": {"k": [1, None]}, "extra": 0.0025}))]
    assert takes(named, f"[{full}]") and not takes(named, f"[{weather}]")
    assert not takes(named, f"[{full}, {full}]")  # (a named function: one call)
    thinking = tool_grammar(tools, "required", "pythonic", reasoning_parser="qwen3")
    assert takes(thinking, f"<think>hmm</think>\n\n[{weather}]")
    assert not takes(thinking, "<think>hmm</think>\n\nhello")
    for bad in ("[search()]",  # the required query left out
                "[search(query='a\rb')]", "[search(query='x', extra=1e999)]",  # (unreadable)
                "[search(limit=1, query='x')]",  # out of the schema's order
                "[search(query=1)]", "[search(query='x', limit='1')]",
                "[get_weather(city='Berlin', days=2, unit='C')]",  # not in the enum
                "[search(query='x', exact=true)]", "hi [search(query='x')]", "[]",
                "[search(query='x')] and more"):
        assert not takes(parallel, bad), bad


def test_forced_pythonic_calls_type_nested_objects():
    """An object parameter with properties is a dict of those keys in order (required
    ones always, no others), each value of its own schema, at any depth; what the grammar
    takes, the parser reads back."""
    from deployments.structured import tool_grammar
    from tests.test_structured_output import grammar_takes
    book = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "required": ["trip"], "properties": {"trip": {
            "type": "object", "required": ["to"], "properties": {
                "to": {"type": "string"}, "nights": {"type": "integer"},
                "rooms": {"type": "array", "items": {"type": "object", "required": ["beds"],
                                                     "properties": {"beds": {"enum": [1, 2]}}}},
                "extras": {"type": "object", "properties": {"it's": {"type": "boolean"}}},
                "notes": {"type": "object"}}}}}}}
    spec = tool_grammar([Tool.model_validate(book)], "required", "pythonic")
    takes = grammar_takes()
    full = ("[book(trip={'to': 'Oslo', 'nights': 2, 'rooms': [{'beds': 1}, {'beds': 2}], "
            "'extras': {\"it's\": True}, 'notes': {'any': [None]}})]")
    for text in (full, "[book(trip={'to': 'Oslo'})]", "[book(trip={'to':'Oslo', 'extras': {}})]"):
        assert takes(spec, text), text
    assert json.loads(make_parser("pythonic").parse(full)[1][0].arguments) == {"trip": {
        "to": "Oslo", "nights": 2, "rooms": [{"beds": 1}, {"beds": 2}],
        "extras": {"it's": True}, "notes": {"any": [None]}}}
    for bad in ("[book(trip={})]",  # the required "to" left out
                "[book(trip={'to': 3})]", "[book(trip={'to': 'Oslo', 'nights': '2'})]",
                "[book(trip={'nights': 2, 'to': 'Oslo'})]",  # out of order
                "[book(trip={'to': 'Oslo', 'pets': 1})]",  # a key it does not have
                "[book(trip={'to': 'Oslo', 'rooms': [{'beds': 3}]})]",
                "[book(trip={'to': 'Oslo', 'extras': {'it': True}})]"):
        assert not takes(spec, bad), bad


def test_pythonic_forcing_leaves_out_what_python_can_not_pass():
    """An optional parameter named as no keyword argument can be is left out; a required
    one, or a function so named, is a 400."""
    from deployments.structured import tool_grammar
    from tests.test_structured_output import grammar_takes
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["a"], "properties": {
            "from": {"type": "string"}, "x-y": {"type": "integer"}, "a": {"type": "integer"}}}}})
    spec = tool_grammar([tool], "required", "pythonic")
    takes = grammar_takes()
    assert takes(spec, "[f(a=1)]") and not takes(spec, "[f(from='x', a=1)]")
    for bad in ({"name": "get-weather"}, {"name": "import"}, {"name": "None"},
                {"name": "\ufb01nd"},  # (Python reads it back as "find")
                {"name": "f", "parameters": {"type": "object", "required": ["class"],
                                             "properties": {"class": {"type": "string"}}}}):
        with pytest.raises(APIError) as e:
            tool_grammar([Tool.model_validate({"type": "function", "function": bad})],
                         "required", "pythonic")
        assert e.value.status == 400 and "not a Python name" in e.value.message
    odd = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": 5, "properties": {"a": {"enum": "ab"}}}}})
    assert takes(tool_grammar([odd], "required", "pythonic"), "[f(a=[1])]")  # (no 500)


@pytest.mark.parametrize("parser,marker_shown", [("mistral", True), ("hermes", False)])
def test_a_format_of_special_markers_keeps_special_tokens_in_its_text(parser, marker_shown):
    from deployments.choice import new_choice
    from engine_actors.checkpoint import load_tokenizer, resolve_model_path
    from engine_actors.config import DEFAULT_MODEL
    from engine_actors.messages import RequestUpdate
    from engine_actors.request import SamplingParams
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    frontend = SimpleNamespace(tokenizer=tokenizer, cfg=SimpleNamespace(reasoning_parser=None))
    choice = new_choice(frontend, req, 0, None, [1],
                        SimpleNamespace(sampling=SamplingParams(max_tokens=64)), True, None,
                        parser)
    body = '[{"name": "now", "arguments": {}}]'
    choice.consume(RequestUpdate([marker] + tokenizer.encode(body, add_special_tokens=False),
                                 "stop"))
    if marker_shown:
        assert choice.tool_calls == [ToolCall("now", "{}")] and choice.text == ""
    else:  # the marker was skipped: the array is content
        assert choice.tool_calls == [] and choice.text == body


# ---- through HTTP, a server with tool_call_parser: mistral --------------------------------
@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(tool_call_parser="mistral"))
    stop_app()


def test_mistral_forced_calls_through_http(url):
    """The grammar writes the marker and the array; the answer is the call alone."""
    deltas = check_forced_calls(url, rounds=1)
    assert not any(d.get("content") for d in deltas)  # the marker and array never leak
    wait_idle(url)


# ---- what a review found: never an exception, never JSON that is not JSON -------------
@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"x": True}}, {"type": "object", "properties": {"x": "s"}},
    {"type": "object", "properties": ["x"]}, {"type": "object"}])
def test_qwen3_coder_takes_schemas_that_are_not_objects(parameters):
    tool = Tool.model_validate({"type": "function",
                                "function": {"name": "f", "parameters": parameters}})
    assert make_parser("qwen3_coder", [tool]).parse(qwen_call("f", x="1")) == \
        (None, [ToolCall("f", '{"x": "1"}')])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("parser,text", [
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": ' + "1" * 4301 + "}}]"),
    ("mistral", "[TOOL_CALLS]f[ARGS]{\"a\": " + "1" * 4301 + "}"),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": ' + "1" * 4301 + "}}]"),
    ("granite", '[{"name": "f", "arguments": {"a": ' + "1" * 4301 + "}}]"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "1" * 4301 + "}}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "1" * 4301 + "}}"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": NaN}}]'),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": 1e999}}]'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": Infinity}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": -Infinity}}'),
    ("pythonic", "[f(a=1e999)]"), ("pythonic", "[f(a=1, a=2)]"),
    ("pythonic", '([g(b="x]")])'), ("pythonic", "# c\n[f(a=1)]")])
def test_what_json_cannot_hold_or_python_cannot_read_is_content(mode, parser, text):
    """Integers past Python's 4300 digits, NaN and infinities; a repeated keyword; and a
    pythonic list that does not start with "[" (streaming would have sent it already)."""
    assert run(parser, text, mode) == (text, [])


def test_qwen3_coder_numbers_json_cannot_hold_stay_strings():
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "number"}, "o": {"type": "object"}}}}})
    parser = make_parser("qwen3_coder", [tool])
    for raw in ("nan", "inf", "1e999"):
        assert json.loads(parser.parse(qwen_call("f", n=raw, o='{"v": NaN}'))[1][0].arguments) \
            == {"n": raw, "o": '{"v": NaN}'}
