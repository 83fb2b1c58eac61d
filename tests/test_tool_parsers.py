from __future__ import annotations

import random

import pytest

from deployments.tool_parsers import (HermesParser, Llama3JsonParser, ToolCall,
                                      ToolCallStream, make_parser)

# "parse": the whole text at once; the others feed a ToolCallStream in chunks (one
# character at a time, or random sizes from a seeded generator).
MODES = ["parse", "stream-1", "stream-random-0", "stream-random-1", "stream-random-2"]


def chunks(text: str, mode: str) -> list[str]:
    if mode == "stream-1":
        return list(text)
    rng = random.Random(int(mode.rsplit("-", 1)[1]))
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[pos:pos + size])
        pos += size
    return pieces


def run(parser_name: str, text: str, mode: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) as a client sees them: streamed content is what add() returned
    followed by finish()'s content."""
    if mode == "parse":
        return make_parser(parser_name).parse(text)
    stream = ToolCallStream(make_parser(parser_name))
    sent = "".join(stream.add(piece) for piece in chunks(text, mode))
    rest, calls = stream.finish()
    return (sent + (rest or "")) or None, calls


WEATHER = ToolCall("get_weather", '{"location": "Paris"}')


# hermes

@pytest.mark.parametrize("mode", MODES)
def test_hermes_one_call(mode):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'
    assert run("hermes", text, mode) == (None, [WEATHER])


@pytest.mark.parametrize("mode", MODES)
def test_hermes_two_calls_with_varied_whitespace(mode):
    text = ('<tool_call>{"name":"get_weather","arguments":{"location":"Paris"}}</tool_call>\n'
            '<tool_call>\n  {"name": "get_time",\n "arguments": {"zone": "CET", "h24": true}}'
            '  \n\n</tool_call>\n')
    assert run("hermes", text, mode) == (
        None, [WEATHER, ToolCall("get_time", '{"zone": "CET", "h24": true}')])


@pytest.mark.parametrize("mode", MODES)
def test_hermes_text_before_and_after(mode):
    text = ('\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"location": "Paris"}}\n</tool_call>\nOne moment. \n')
    assert run("hermes", text, mode) == ("Let me check.\n\nOne moment.", [WEATHER])


GOOD = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}\n</tool_call>',  # no "}"
    '<tool_call>\n{"arguments": {"zone": "CET"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_time", "arguments": ["CET"]}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "get_time", "arguments": "CET"}\n</tool_call>',
    '<tool_call>\n["get_time"]\n</tool_call>',
])
def test_hermes_malformed_call_is_content_and_good_one_kept(mode, bad):
    assert run("hermes", bad + "\n" + GOOD, mode) == (bad, [WEATHER])
    assert run("hermes", GOOD + "\n" + bad, mode) == (bad, [WEATHER])


@pytest.mark.parametrize("mode", ["parse", "stream-random-0"])
def test_calls_nested_past_the_recursion_limit_are_content(mode):
    deep = "[" * 5000 + "]" * 5000
    hermes = f'<tool_call>\n{{"name": "f", "arguments": {{"x": {deep}}}}}\n</tool_call>'
    assert run("hermes", hermes + "\n" + GOOD, mode) == (hermes, [WEATHER])
    llama = f'{{"name": "f", "parameters": {{"x": {deep}}}}}'
    assert run("llama3_json", llama, mode) == (llama, [])


@pytest.mark.parametrize("mode", MODES)
def test_hermes_unterminated_call_at_end_is_content(mode):
    text = GOOD + '\n<tool_call>\n{"name": "get_time", "argu'
    assert run("hermes", text, mode) == ('<tool_call>\n{"name": "get_time", "argu', [WEATHER])


@pytest.mark.parametrize("mode", MODES)
def test_hermes_call_left_open_before_a_good_one(mode):
    text = '<tool_call>\n{"name": "get_ti\n' + GOOD
    assert run("hermes", text, mode) == ('<tool_call>\n{"name": "get_ti', [WEATHER])


@pytest.mark.parametrize("mode", MODES)
def test_hermes_no_calls(mode):
    text = "It is sunny in Paris: 3 < 5 and <tools> are not <tool_call"
    assert run("hermes", text, mode) == (text, [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["Here it comes <tool", "Here it comes <",
                                  "Here it comes <tool_call>"])
def test_hermes_partial_marker_at_end_is_content(mode, text):
    assert run("hermes", text, mode) == (text, [])


@pytest.mark.parametrize("mode", MODES)
def test_hermes_unicode_arguments(mode):
    text = ('<tool_call>{"name": "météo", "arguments": {"city": "Z\\u00fcrich", '
            '"note": "晴れ ☀"}}</tool_call>')
    assert run("hermes", text, mode) == (
        None, [ToolCall("météo", '{"city": "Zürich", "note": "晴れ ☀"}')])


def test_hermes_stream_sends_content_before_marker_and_holds_from_it():
    stream = ToolCallStream(HermesParser())
    assert stream.add("  Let me ") == "Let me"  # leading space dropped, trailing held
    assert stream.add("check. <to") == " check."
    assert stream.add("ol_call>\n") == ""
    assert stream.add('{"name": "get_weather", "arguments": {"location": "Paris"}}') == ""
    assert stream.add("\n</tool_call> Done.") == ""
    assert stream.finish() == ("  Done.", [WEATHER])  # the spaces before and after the call


def test_hermes_stream_partial_marker_that_turns_out_plain():
    stream = ToolCallStream(HermesParser())
    assert stream.add("a <tool") == "a"
    assert stream.add("s> b") == " <tools> b"
    assert stream.finish() == (None, [])


# llama3_json

@pytest.mark.parametrize("mode", MODES)
def test_llama3_one_call(mode):
    text = '{"name": "get_weather", "parameters": {"location": "Paris"}}'
    assert run("llama3_json", text, mode) == (None, [WEATHER])


@pytest.mark.parametrize("mode", MODES)
def test_llama3_leading_whitespace_and_arguments_key(mode):
    text = ' \n {"name":"get_weather","arguments":{"location":"Paris"}}\n'
    assert run("llama3_json", text, mode) == (None, [WEATHER])


@pytest.mark.parametrize("mode", MODES)
def test_llama3_calls_separated_by_semicolon(mode):
    text = ('{"name": "get_weather", "parameters": {"location": "Paris"}}; '
            '{"name": "note", "arguments": {"text": "a; b {c}"}};')
    assert run("llama3_json", text, mode) == (
        None, [WEATHER, ToolCall("note", '{"text": "a; b {c}"}')])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"location": "Paris"}}; {"name": "get_time",',
    '{"name": "get_weather", "parameters": {"location": "Paris"}}; {"parameters": {}}',
    '{"name": "get_weather", "parameters": {"location": "Paris"}}; {"name": "f", "parameters": 1}',
    '{"name": "get_weather", "parameters": {"location": "Paris"}} and then some',
    '{"name": "get_weather", "parameters": {"location": "Paris"}} {"name": "f"}',
    '{}',
    '{',
])
def test_llama3_malformed_is_all_content(mode, text):
    assert run("llama3_json", "\n" + text + " ", mode) == (text, [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text", ["The weather in Paris is sunny.",
                                  'Answer: {"name": "get_weather", "parameters": {}}'])
def test_llama3_no_calls(mode, text):
    assert run("llama3_json", text, mode) == (text, [])


@pytest.mark.parametrize("mode", MODES)
def test_llama3_only_whitespace(mode):
    assert run("llama3_json", " \n\t ", mode) == (None, [])


@pytest.mark.parametrize("mode", MODES)
def test_llama3_unicode_arguments(mode):
    text = '{"name": "météo", "parameters": {"city": "Z\\u00fcrich", "note": "晴れ ☀"}}'
    assert run("llama3_json", text, mode) == (
        None, [ToolCall("météo", '{"city": "Zürich", "note": "晴れ ☀"}')])


def test_llama3_stream_content_passes_through_at_once():
    stream = ToolCallStream(Llama3JsonParser())
    assert stream.add("  \n") == ""
    assert stream.add("Sure") == "Sure"
    assert stream.add(", {x} ") == ", {x}"
    assert stream.add("done") == " done"
    assert stream.finish() == (None, [])


def test_llama3_stream_holds_everything_from_a_brace():
    stream = ToolCallStream(Llama3JsonParser())
    assert stream.add(" ") == ""
    assert stream.add('{"name": "get_weather", ') == ""
    assert stream.add('"parameters": {"location": "Paris"}}') == ""
    assert stream.finish() == (None, [WEATHER])


@pytest.mark.parametrize("text, index", [
    ("", 0), ("plain", 5), ("a <", 2), ("a <tool", 2), ("a <tool_call", 2), ("a <tools", 8),
    ("a <tool_call>{", 2), ("x <tool_call>{} <", 2), ("<tool_call", 0),
])
def test_hermes_could_start_call(text, index):
    assert HermesParser().could_start_call(text) == index


@pytest.mark.parametrize("text, index", [
    ("", 0), (" \n", 0), ("  {", 0), ('{"name"', 0), ("Sure", 4), (" Sure {", 7),
])
def test_llama3_could_start_call(text, index):
    assert Llama3JsonParser().could_start_call(text) == index


# shared

def test_to_openai_shape():
    assert WEATHER.to_openai("call_1") == {
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}


def test_make_parser_names():
    assert type(make_parser("hermes")) is HermesParser
    assert type(make_parser("llama3_json")) is Llama3JsonParser


def test_make_parser_unknown_name():
    with pytest.raises(ValueError, match=r"'xlam'.*hermes, llama3_json, qwen3_coder"):
        make_parser("xlam")


@pytest.mark.parametrize("parser_name,text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}'
               '</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris"}}; '
                    '{"name": "b", "parameters": {}}')])
def test_without_parallel_tool_calls_only_the_first_call_is_kept(parser_name, text):
    stream = ToolCallStream(make_parser(parser_name), max_calls=1)
    assert stream.add(text) == ""
    assert stream.finish() == (None, [WEATHER])


@pytest.mark.parametrize("parser_name,calls", [
    ("hermes", ['<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
                '</tool_call>', '<tool_call>\n{"name": "b", "arguments": {"s": "x\\ny"}}\n'
                                '</tool_call>']),
    ("llama3_json", ['{"name": "get_weather", "parameters": {"location": "Paris"}}',
                     '{"name": "b", "parameters": {"s": "x; y"}}'])])
def test_forced_calls_cut_by_max_tokens_keep_the_whole_ones(parser_name, calls):
    """A grammar forced the calls; max_tokens cut the third (a separator also inside the
    second's arguments): the two whole calls come back, no content."""
    from deployments.tool_parsers import CALL_SEPARATORS
    sep = CALL_SEPARATORS[parser_name]
    text = sep.join(calls + [calls[0][:25]])
    second = make_parser(parser_name).parse(calls[1])[1]
    for cut in (text, text[:len(sep.join(calls)) + len(sep)]):
        stream = ToolCallStream(make_parser(parser_name), forced_separator=sep)
        assert stream.add(cut) == ""
        assert stream.finish() == (None, [WEATHER] + second)
    stream = ToolCallStream(make_parser(parser_name), forced_separator=sep)
    stream.add(calls[0][:25])
    assert stream.finish() == (None, [])
