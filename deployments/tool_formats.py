"""The tool-call formats of Qwen3-Coder, Mistral, IBM Granite and pythonic models (vLLM's
parsers of those names), beside deployments/tool_parsers.py's hermes and llama3_json.

- qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`. A value is raw text: it becomes the JSON type that the
  request's tool declares for that parameter (a string when it declares none).
- mistral: `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}` (Mistral 7B
  v0.3, Nemo, Small 3.0/3.1), or by `NAME[ARGS]{...}` (v11 tokenizers: Small 3.2, Magistral,
  Devstral; `NAME[CALL_ID]ID[ARGS]{...}` too), once per call. Text before the first marker
  is content.
- granite: `<|tool_call|>` followed by a JSON array of calls (Granite 3.x); an output that
  is such an array without the marker is calls too, as vLLM's parser takes it.
- pythonic (Llama 3.2 1B/3B, Llama 4): the whole output is a Python list of calls with
  keyword arguments of literal values, `[get_weather(city="Paris", days=2), now()]`.

[TOOL_CALLS] and <|tool_call|> are special tokens: the text of a request parsed for calls
keeps special tokens (needs_special_tokens). A malformed call is content, never an error.
"""
from __future__ import annotations

import ast
import math
import re

from deployments.tool_calls import (DECODER, LEADING_SPACE, ToolCall, call_of,
                                    content_or_none, make_call, marker_start,
                                    whole_output_start)

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
MISTRAL_MARKER, GRANITE_MARKER = "[TOOL_CALLS]", "<|tool_call|>"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
NAME = re.compile(r"[A-Za-z0-9_.:-]+")


class Qwen3CoderCalls:
    """Reads the body of one qwen3_coder `<tool_call>` with the request's tools' types."""

    def __init__(self, tools=None):
        self.types = {t.function.name: _declared_types(t.function.parameters)
                      for t in tools or ()}

    def read(self, body: str) -> ToolCall | None:
        m = FUNCTION.fullmatch(body.strip())
        if m is None:
            return None
        name, inner, arguments, pos = m[1].strip(), m[2], {}, 0
        types = self.types.get(name, {})
        for p in PARAMETER.finditer(inner):
            if inner[pos:p.start()].strip():
                return None  # text between parameters
            key = p[1].strip()
            arguments[key] = typed_value(_one_newline_off(p[2]), types.get(key))
            pos = p.end()
        if inner[pos:].strip():
            return None
        return call_of(name, arguments)


def _declared_types(parameters) -> dict:
    """Parameter name -> the "type" its schema declares (None where it declares none, or
    the schema is not an object: JSON Schema allows true, false)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {k: v.get("type") if isinstance(v, dict) else None for k, v in properties.items()}


def _one_newline_off(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed_value(raw: str, declared):
    """A qwen3_coder parameter's text as the JSON type its schema declares (a list of
    types: the first that is not "null"). `null` is null; what does not read as the declared
    type stays a string, as vLLM's parser keeps it."""
    if isinstance(declared, list):
        declared = next((t for t in declared if t != "null"), None)
    if raw.strip().lower() == "null":
        return None
    if declared in (None, "string"):
        return raw
    text = raw.strip()
    try:
        if declared == "integer":
            return int(text)
        if declared == "number":
            number = float(text)
            if not math.isfinite(number):  # nan, inf, 1e999: not JSON
                return raw
            return int(text) if re.fullmatch(r"-?\d+", text) else number
        if declared == "boolean":
            return {"true": True, "false": False}[text.lower()]
        return DECODER.decode(text)  # object, array
    except (ValueError, KeyError, RecursionError):
        return raw


class MarkerParser:
    """Calls after a marker, each run of them up to the next marker: mistral's and
    granite's formats."""
    needs_special_tokens = True
    marker = MISTRAL_MARKER

    def __init__(self, tools=None):
        pass

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pieces = text.split(self.marker)
        content, calls = [pieces[0]], []
        for piece in pieces[1:]:
            read = self.read_calls(piece)
            if read is None:  # malformed: its text is content
                content.append(self.marker + piece)
                continue
            calls += read[0]
            content.append(read[1])
        return content_or_none("".join(content)), calls

    def read_calls(self, piece: str) -> tuple[list[ToolCall], str] | None:
        """(the calls at the start of `piece`, the text after them), or None."""
        return read_array(piece)

    def could_start_call(self, text: str) -> int:
        return marker_start(text, self.marker)


def read_array(piece: str) -> tuple[list[ToolCall], str] | None:
    """A JSON array of calls at the start of `piece` (after whitespace) and what follows."""
    pos = LEADING_SPACE.match(piece).end()
    try:
        items, end = DECODER.raw_decode(piece, pos)
    except (ValueError, RecursionError):  # (ValueError: JSON's, and integers past 4300 digits)
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [make_call(item, ("arguments", "parameters")) for item in items]
    return (calls, piece[end:]) if None not in calls else None


class MistralParser(MarkerParser):
    def read_calls(self, piece: str) -> tuple[list[ToolCall], str] | None:
        if piece.lstrip().startswith("["):
            return read_array(piece)
        name, args_mark, rest = piece.partition(ARGS)  # v11: NAME[ARGS]{...}
        name = name.partition(CALL_ID)[0].strip()
        if not args_mark or NAME.fullmatch(name) is None:
            return None
        try:
            arguments, end = DECODER.raw_decode(rest, LEADING_SPACE.match(rest).end())
        except (ValueError, RecursionError):
            return None
        call = call_of(name, arguments) if isinstance(arguments, dict) else None
        return ([call], rest[end:]) if call is not None else None


class GraniteParser(MarkerParser):
    marker = GRANITE_MARKER

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.marker not in text and text.lstrip().startswith("["):
            read = read_array(text)  # a bare array: calls if it is all of the output
            if read is not None and not read[1].strip():
                return None, read[0]
        return super().parse(text)

    def could_start_call(self, text: str) -> int:
        return min(whole_output_start(text, "["), marker_start(text, self.marker))


class PythonicParser:
    needs_special_tokens = False

    def __init__(self, tools=None):
        pass

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()  # a list written as such: "[" first, as streaming decides
        calls = python_calls(body) if body.startswith("[") else None
        return (None, calls) if calls else (content_or_none(text), [])

    def could_start_call(self, text: str) -> int:
        return whole_output_start(text, "[")


def python_calls(text: str) -> list[ToolCall] | None:
    """`[f(a=1), g()]`: each call's keyword arguments as literals, or None if `text` is
    anything else (positional arguments, expressions, a value JSON cannot hold)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        names = [kw.arg for kw in node.keywords] if isinstance(node, ast.Call) else [None]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                or None in names or len(set(names)) < len(names):  # (f(a=1, a=2))
            return None
        try:
            call = call_of(node.func.id, {kw.arg: ast.literal_eval(kw.value)
                                          for kw in node.keywords})
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if call is None:  # a value JSON cannot hold: a set, bytes, inf
            return None
        calls.append(call)
    return calls
