"""Reasoning models: the text a model writes between <think> and </think> is its reasoning,
returned apart from the answer (vLLM's `reasoning` field on chat completions, a `reasoning`
output item on the Responses API), when the server runs with a `reasoning_parser`:

- `qwen3` (Qwen3, whose output starts with <think> while thinking is on, and has no
  reasoning when a chat template turns it off: `chat_template_kwargs: {"enable_thinking":
  false}`): reasoning only if the output starts with <think>;
- `deepseek_r1` (DeepSeek-R1 and the models whose chat template ends the prompt in <think>,
  such as QwQ and Qwen3's thinking-only releases): the output starts in reasoning (a
  leading <think> is dropped).

Reasoning ends at the first </think>; an output cut before it is all reasoning. The blank
lines the model writes after </think> are not part of the answer. Tool calls are parsed
from the answer only, and a grammar (structured output, forced tool calls) applies to the
answer only (structured.reasoning_grammar): when </think> is one token of the vocabulary,
the engine masks nothing until the model writes that token, as vLLM does.
"""
from __future__ import annotations

from deployments.protocol import APIError

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningStream:
    """Splits one choice's text, as it streams, into reasoning and answer. Text that may be
    the start of a tag, or newlines that may come before </think>, are held until the next
    delta decides them, so the split does not depend on where deltas break."""

    def __init__(self, parser: str):
        self.starts_in_reasoning = parser == "deepseek_r1"
        self.state = "start"  # "start" (no text yet), "reasoning" or "answer"
        self.held = ""
        self.is_skipping_newlines = True  # after a tag (and at the start): dropped
        self.is_ended = False  # </think> came

    def add(self, delta: str, is_final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text of the next delta; `is_final`: nothing follows."""
        text, self.held = self.held + delta, ""
        thought = ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(START):
                text, self.state = stripped[len(START):], "reasoning"
            elif START.startswith(stripped) and not is_final:
                self.held = text  # maybe the beginning of <think>
                return "", ""
            else:
                self.state = "reasoning" if self.starts_in_reasoning else "answer"
        if self.state == "reasoning":
            text = self._skip_newlines(text)
            end = text.find(END)
            if end < 0:
                if is_final:
                    return text, ""
                body = text[:len(text) - _partial_suffix(text, END)]
                body = body.rstrip("\n")  # newlines that may come before </think>
                self.held = text[len(body):]
                return body, ""
            thought, text, self.state = text[:end].rstrip("\n"), text[end + len(END):], "answer"
            self.is_skipping_newlines = self.is_ended = True
        return thought, self._skip_newlines(text)

    def _skip_newlines(self, text: str) -> str:
        if self.is_skipping_newlines:
            text = text.lstrip("\n")
            self.is_skipping_newlines = not text
        return text


def continues_answer(req) -> bool:
    """A chat request whose output continues its last message (continue_final_message):
    that output is answer, not reasoning."""
    return getattr(req, "continue_final_message", False)


def output_parser(req, parser: str | None) -> str | None:
    """The reasoning parser of a chat request's output (none for a continued answer)."""
    return None if continues_answer(req) else parser


def thinking_budget(req, parser: str | None, tokenizer) -> tuple[int, int, int] | None:
    """The engine's thinking budget for a request's thinking_token_budget (None: none, or
    an output that continues the last message):
    (<think>'s id, or -1 when the output starts in reasoning; </think>'s id; the budget)."""
    budget = getattr(req, "thinking_token_budget", None)
    if budget is None or budget == -1 or continues_answer(req):  # (-1: no limit, as vLLM)
        return None
    start, end = think_token_ids(tokenizer) if parser else (None, None)
    if end is None or (parser == "qwen3" and start is None):
        raise APIError(400, "thinking_token_budget needs a reasoning model: the server's "
                            "reasoning_parser, and </think> (with qwen3, <think> too) one "
                            "token of the vocabulary", "thinking_token_budget",
                       "unsupported_parameter")
    return (start if parser == "qwen3" else -1), end, budget


def think_token_ids(tokenizer) -> tuple[int | None, int | None]:
    """The ids of <think> and </think> where each is one token of the vocabulary (None
    where it is not: the text is then written in several tokens)."""
    def one(tag: str) -> int | None:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None
    return one(START), one(END)


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def reasoning_tokens(tokenizer, token_ids: list[int], stream: ReasoningStream) -> int:
    """How many generated tokens are reasoning, its tags included: all of them while it has
    not ended, up to the one that completes </think> once it has, none if there was none."""
    if not stream.is_ended:
        return len(token_ids) if stream.state == "reasoning" else 0
    # the shortest prefix whose text holds </think> (the decoded text only grows)
    low, high = 1, len(token_ids)
    while low < high:
        mid = (low + high) // 2
        if END in tokenizer.decode(token_ids[:mid], skip_special_tokens=True):
            high = mid
        else:
            low = mid + 1
    return low
