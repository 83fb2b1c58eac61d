"""Tool calls found in a chat model's generated text, as OpenAI `tool_calls`.

Formats (vLLM's `--tool-call-parser` names):
- "hermes" (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, with text before, between and after.
- "llama3_json" (Llama 3.1/3.2): the whole output is `{"name": ..., "parameters": {...}}`
  (or "arguments"), possibly several objects separated by ";".
- "qwen3_coder" (Qwen3-Coder): hermes' markers around `<function=NAME>` and
  `<parameter=KEY>value</parameter>` lines (deployments/tool_formats.py).
- "mistral", "granite", "pythonic": deployments/tool_formats.py.

A malformed call is never an error: its raw text is returned as content instead.
"""
from __future__ import annotations

from deployments.tool_calls import (DECODER, LEADING_SPACE, ToolCall, ToolParser,
                                    content_or_none, make_call, marker_start,
                                    whole_output_start)
from deployments.tool_formats import GraniteParser, MistralParser, PythonicParser, \
    Qwen3CoderCalls

CALL_START, CALL_END = "<tool_call>", "</tool_call>"  # hermes


class HermesParser:
    needs_special_tokens = False

    def __init__(self, tools=None):
        pass

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while (start := text.find(CALL_START, pos)) >= 0:
            content.append(text[pos:start])
            end = text.find(CALL_END, start + len(CALL_START))
            if end < 0:  # unterminated: the rest is content
                pos = start
                break
            again = text.find(CALL_START, start + len(CALL_START), end)
            if again >= 0:  # a call left open: it is content, and the next one may be good
                content.append(text[start:again])
                pos = again
                continue
            pos = end + len(CALL_END)
            call = self.read_call(text[start + len(CALL_START):end])
            if call is None:
                content.append(text[start:pos])
            else:
                calls.append(call)
        content.append(text[pos:])
        return content_or_none("".join(content)), calls

    def read_call(self, body: str) -> ToolCall | None:
        """The call between the markers, or None if it is not one."""
        try:  # (nested past Python's recursion limit, or not JSON: not a call either)
            return make_call(DECODER.decode(body.strip()), ("arguments",))
        except (ValueError, RecursionError):
            return None

    def could_start_call(self, text: str) -> int:
        return marker_start(text, CALL_START)


class Llama3JsonParser:
    needs_special_tokens = False

    def __init__(self, tools=None):
        pass

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = self._parse_calls(text)
        if calls is None:
            return content_or_none(text), []
        return None, calls

    def _parse_calls(self, text: str) -> list[ToolCall] | None:
        """The calls, if the whole text is call objects separated by ";", else None."""
        calls: list[ToolCall] = []
        pos = LEADING_SPACE.match(text).end()
        if not text.startswith("{", pos):
            return None
        while pos < len(text):
            # raw_decode rather than split(";"): a ";" may be inside a JSON string.
            try:
                obj, pos = DECODER.raw_decode(text, pos)
                call = make_call(obj, ("parameters", "arguments"))
            except (ValueError, RecursionError):
                return None
            if call is None:
                return None
            calls.append(call)
            pos = LEADING_SPACE.match(text, pos).end()
            if pos < len(text):
                if text[pos] != ";":
                    return None
                pos = LEADING_SPACE.match(text, pos + 1).end()  # a trailing ";" is allowed
        return calls

    def could_start_call(self, text: str) -> int:
        # Only the first non-whitespace character decides: "{" makes the whole output
        # calls, anything else makes it all content. Whitespace alone decides nothing.
        return whole_output_start(text, "{")


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's calls: hermes' markers around `<function=NAME>` and its parameters."""

    def __init__(self, tools=None):
        self.calls = Qwen3CoderCalls(tools)

    def read_call(self, body: str) -> ToolCall | None:
        return self.calls.read(body)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
    "mistral": MistralParser, "granite": GraniteParser, "pythonic": PythonicParser}
# what a forcing grammar writes between calls (deployments/structured.py), where the calls
# before the one max_tokens cut are whole (pythonic's list is not: its forced calls,
# deployments/pythonic_grammar.py, come back only when the list is)
CALL_SEPARATORS = {"hermes": "\n", "llama3_json": "; ", "qwen3_coder": "\n", "mistral": "\n",
                   "granite": "\n"}


def make_parser(name: str, tools=None) -> ToolParser:
    """The parser for a format name, one of PARSERS; `tools`: the request's (qwen3_coder
    reads its parameters' types from them)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name](tools)


class ToolCallStream:
    """Streaming: feed text deltas; returns content that is safe to send now (never a part
    of a tool call), holding back anything that may be a call; finish() parses what was held.

    The sent pieces and finish()'s content concatenate to exactly parse(whole text)'s
    content: whitespace at the start is dropped and whitespace at the end of what is safe
    is held until something follows it, as parse strips both.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None,
                 forced_separator: str | None = None):
        self.parser = parser
        self.max_calls = max_calls  # later calls are dropped (parallel_tool_calls: false -> 1)
        # calls forced by a grammar (tool_choice "required" or named): the text is nothing
        # but calls joined by this separator, unless max_tokens cut the last one
        self.forced_separator = forced_separator
        self.text = ""
        self.num_sent = 0  # text[:num_sent] is decided: sent, or leading whitespace dropped
        self.num_chars_sent = 0

    def add(self, delta: str) -> str:
        """The content to send now (may be "")."""
        self.text += delta
        # The whole text is passed each time: llama3_json decides on its first character.
        # The rescan is a C-speed find over one response, cheap next to generating it.
        num_safe = max(self.parser.could_start_call(self.text), self.num_sent)
        piece = self.text[self.num_sent:num_safe].rstrip()
        if not piece:
            return ""
        self.num_sent += len(piece)
        if self.num_chars_sent == 0:
            piece = piece.lstrip()
        self.num_chars_sent += len(piece)
        return piece

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """(the content not yet sent, or None if there is none; the calls)."""
        content, calls = self.parser.parse(self.text)
        if content is not None and self.forced_separator is not None:
            content, calls = None, self._whole_calls()
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        # Invariant: what was sent is a prefix of content (it was text before any call).
        rest = (content or "")[self.num_chars_sent:]
        return rest or None, calls

    def _whole_calls(self) -> list[ToolCall]:
        """The calls before the one that max_tokens cut (forced calls only: a separator
        may also be inside a call's arguments, so cut at each one from the end)."""
        end = len(self.text)
        while (end := self.text.rfind(self.forced_separator, 0, end)) > 0:
            content, calls = self.parser.parse(self.text[:end])
            if content is None:
                return calls
        return []
