"""A fine-tuning job's training file (JSON Lines) as token ids and loss masks.

Each line is `{"prompt": str, "completion": str}` (the completion is trained on, followed
by the end-of-sequence token) or `{"messages": [{"role", "content"}, ...]}` (the assistant
messages are trained on, each as the chat template renders it, except those with OpenAI's
`"weight": 0`), with OpenAI's tool calls: assistant messages with `tool_calls`, `tool`
messages with their results, and the line's `tools` rendered by the template as the chat
route renders a request's. Prompts are tokenized as the completions and chat routes
tokenize them, so the served adapter sees what it was trained on. The first token of a
sequence is never trained on (nothing before it predicts it). A bad line is a 400 that
names it.
"""
from __future__ import annotations

import json

from pydantic import ValidationError

from deployments.chat_protocol import ChatMessage, Tool
from deployments.protocol import APIError
from deployments.request_body import check_unicode, validation_error

ROLES = ("system", "user", "assistant", "tool")


def _error(line: int, message: str) -> APIError:
    return APIError(400, f"training_file line {line}: {message}", "training_file",
                    "invalid_training_file")


def parse_training_file(content: bytes, tokenizer, max_tokens: int
                        ) -> list[tuple[list[int], list[bool]]]:
    examples = []
    for number, row in read_rows(content):
        if "messages" in row:
            tokens, mask = _chat(row["messages"], row.get("tools"), tokenizer, number)
        else:
            tokens, mask = _completion(row["prompt"], row["completion"], tokenizer)
        if len(tokens) > max_tokens:
            raise _error(number, f"{len(tokens)} tokens, over the limit of {max_tokens}")
        mask[0] = False  # nothing before the first token predicts it
        if not any(mask):
            raise _error(number, "no token to train on (a completion needs a token before "
                                 "it: give a prompt)")
        examples.append((tokens, mask))
    return examples


def read_rows(content: bytes) -> list[tuple[int, dict]]:
    """The examples of a training file as (line number, row), each of a known shape (no
    tokenizer needed: the CLI checks a file with this before it sends it)."""
    try:  # (a byte order mark, as some editors write, is not part of the first line)
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise APIError(400, "training_file is not UTF-8 text", "training_file",
                       "invalid_training_file") from None
    rows = []
    # lines end at "\n" only: JSON strings may hold U+2028 and the like unescaped, which
    # str.splitlines would split at ("\r" before it is whitespace to JSON)
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise _error(number, f"not valid JSON: {e}") from None
        except RecursionError:
            raise _error(number, "nested too deeply") from None
        if not isinstance(row, dict):
            raise _error(number, "each line must be a JSON object")
        if "\\u" in line:
            try:
                check_unicode(row)
            except APIError as e:
                raise _error(number, e.message) from None
        if "messages" in row:
            _check_messages(row["messages"], number)
            _check_tools(row.get("tools"), number)
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            if not row["completion"]:
                raise _error(number, "completion must not be empty")
        else:
            raise _error(number, 'expected {"prompt": string, "completion": string} or '
                                 '{"messages": [...]}')
        rows.append((number, row))
    if not rows:
        raise APIError(400, "training_file has no examples", "training_file",
                       "invalid_training_file")
    return rows


def _check_messages(messages, number: int) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ROLES and (
                isinstance(m.get("content"), str) or m.get("tool_calls") and m.get("content")
                is None) for m in messages):
        raise _error(number, "messages must be a non-empty list of {\"role\": one of "
                             f"{', '.join(ROLES)}, \"content\": string (or null beside "
                             "an assistant's tool_calls)}")
    for i, m in enumerate(messages):
        if m.get("tool_calls") is not None and m["role"] != "assistant":
            raise _error(number, f"messages[{i}].tool_calls: only assistant messages make "
                                 "tool calls")
        try:  # as the chat route takes a message (tool calls' shape, tool_call_id, name)
            ChatMessage.model_validate(_without_weight(m))
        except ValidationError as e:
            raise _error(number, validation_error(e, f"messages[{i}]").message) from None
        if "weight" in m and (m["role"] != "assistant" or type(m["weight"]) is not int
                              or m["weight"] not in (0, 1)):
            raise _error(number, f"messages[{i}].weight: only assistant messages take a "
                                 "weight, 0 (not trained on) or 1")
    if not any(_trained(m) for m in messages):
        raise _error(number, "messages have no assistant message to train on")


def _check_tools(tools, number: int) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _error(number, "tools must be a list of tools, as a chat request's")
    for i, tool in enumerate(tools):
        try:
            Tool.model_validate(tool)
        except ValidationError as e:
            raise _error(number, validation_error(e, f"tools[{i}]").message) from None


def _without_weight(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "weight"}


def _trained(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("weight", 1) == 1


def _completion(prompt: str, completion: str, tokenizer):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)  # "": BOS, if any
    target = tokenizer.encode(completion, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        target.append(tokenizer.eos_token_id)
    return prompt_ids + target, [False] * len(prompt_ids) + [True] * len(target)


def _chat(messages, tools, tokenizer, number: int):
    tokens, mask = [], []
    # as the chat route renders a request (Frontend.chat_ids): tool call arguments as objects
    rendered = [ChatMessage.model_validate(_without_weight(m)).for_template() for m in messages]
    tools = [Tool.model_validate(t).model_dump(by_alias=True, exclude_none=True)
             for t in tools] if tools else None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:  # the assistant message: what the template adds after the prompt before it
            prompt = _template(tokenizer, rendered[:i], True, tools) if i else []
            full = _template(tokenizer, rendered[:i + 1], False, tools)
        except Exception as e:
            raise _error(number, f"messages could not be formatted: {e}") from None
        if full[:len(prompt)] != prompt or prompt[:len(tokens)] != tokens:
            raise _error(number, "the chat template does not render the conversation "
                                 "incrementally; use prompt/completion lines")
        mask += [False] * (len(prompt) - len(tokens)) \
            + [_trained(message)] * (len(full) - len(prompt))
        tokens = full
    return tokens, mask


def _template(tokenizer, messages, generation_prompt: bool, tools) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=generation_prompt,
                                        return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
