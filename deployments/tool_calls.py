"""What every tool-call format shares: a call, how a decoded JSON value becomes one, and the
parser interface (deployments/tool_parsers.py, deployments/tool_formats.py)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Protocol

LEADING_SPACE = re.compile(r"\s*")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialized with json.dumps(obj, ensure_ascii=False)

    def to_openai(self, call_id: str) -> dict:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def make_call(obj, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call that a decoded JSON value describes, or None if it is not a call.
    A call without arguments gets {} (models write {"name": "f"} for functions of no
    parameters)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if not isinstance(arguments, dict):
        return None
    return call_of(obj["name"], arguments)


def call_of(name: str, arguments: dict) -> ToolCall | None:
    """The call, its arguments as JSON; None when JSON cannot hold them (NaN, infinity)."""
    try:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError, RecursionError):
        return None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


# strict JSON: NaN, Infinity and numbers past float's range are not values (json's default
# takes them, and a call's arguments must be JSON); a too long integer raises ValueError too
DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


def content_or_none(text: str) -> str | None:
    return text.strip() or None


def marker_start(text: str, marker: str) -> int:
    """Where `marker` starts in `text`, or where a prefix of it ends `text`, else len(text):
    what is before can be sent while streaming."""
    start = text.find(marker)
    if start >= 0:
        return start
    # Longest first: the earliest index where a partial marker may begin.
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


def whole_output_start(text: str, first_chars: str) -> int:
    """For formats whose calls are the whole output: 0 (hold everything) while the first
    non-whitespace character is one of `first_chars` or not yet there, else len(text)."""
    first = LEADING_SPACE.match(text).end()
    return 0 if first == len(text) or text[first] in first_chars else len(text)


class ToolParser(Protocol):
    # the format's markers are special tokens: the text must keep them (vLLM's parsers of
    # those formats turn skip_special_tokens off too)
    needs_special_tokens: bool

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside calls with surrounding whitespace stripped, or None if empty;
        the calls)."""
        ...

    def could_start_call(self, text: str) -> int:
        """The index in `text` from which a tool call may be starting, or len(text) when
        all of `text` is plain content (streaming: what is before the index can be sent)."""
        ...
