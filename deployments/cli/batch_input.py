"""What `orca-serve batch` reads: JSON Lines files, or FineInfer's `["p1", "p2"] [32, 64]`
form given on the command line. Input is checked here, before anything is sent, so a
malformed file fails with its name and line number instead of a half-submitted job.

Each request is checked against the server's own schema (`deployments.batch_protocol.BatchItem`),
so the CLI accepts exactly what the server accepts (token-id prompts, deadline_ms, ...).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from pydantic import ValidationError

from deployments.cli.http import CLIError
from deployments.batch_protocol import BatchItem

# The server ignores fields it does not know; the CLI refuses them, since a misspelt one
# ("max_token") would otherwise be dropped silently.
REQUEST_FIELDS = tuple(BatchItem.model_fields)
USAGE_ERROR = 2  # exit status for bad input, as argparse uses


@dataclass(slots=True)
class BatchInput:
    """One batch to submit: where it came from, and its request bodies (as the user wrote
    them, plus max_tokens: the schema's other defaults are the server's to fill in)."""
    source: str
    requests: list[dict]


def read_sources(sources: list[str], default_max_tokens: int,
                 batch_size: int | None = None) -> list[BatchInput]:
    """One batch per source (a file, `-` for stdin, or an inline FineInfer list), each split
    into batches of at most `batch_size` requests when given."""
    batches = []
    for i, source in enumerate(sources, 1):
        name = source
        if source == "-":
            name = "<stdin>"
            reqs = parse_jsonl(sys.stdin.read(), name, default_max_tokens)
        elif source.lstrip().startswith("[") and not os.path.exists(source):
            name = f"argument {i}"
            reqs = parse_fineinfer(source, name, default_max_tokens)
        else:
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise CLIError(f"cannot read {source}: {e.strerror}", USAGE_ERROR) from None
            except UnicodeDecodeError:
                raise CLIError(f"{source}: not UTF-8 text", USAGE_ERROR) from None
            reqs = parse_jsonl(text, source, default_max_tokens)
        if not reqs:
            raise CLIError(f"{name}: no requests in it", USAGE_ERROR)
        step = batch_size or len(reqs)
        batches += [BatchInput(name, reqs[k:k + step]) for k in range(0, len(reqs), step)]
    return batches


def parse_jsonl(text: str, name: str, default_max_tokens: int) -> list[dict]:
    """Each non-blank line: {"prompt": "...", "max_tokens": 32, ...} or a bare JSON string."""
    requests = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise CLIError(f"{where}: not valid JSON ({e.msg} at column {e.colno})",
                           USAGE_ERROR) from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict):
            raise CLIError(f"{where}: expected an object like "
                           '{"prompt": "...", "max_tokens": 32} or a JSON string', USAGE_ERROR)
        requests.append(_request(item, where, default_max_tokens))
    return requests


def parse_fineinfer(text: str, name: str, default_max_tokens: int) -> list[dict]:
    """`["p1", "p2"] [32, 64]`: prompts, then optionally one max_tokens per prompt."""
    decoder = json.JSONDecoder()
    text = text.strip()
    form = 'expected ["prompt 1", "prompt 2"] optionally followed by [32, 64]'
    try:
        prompts, end = decoder.raw_decode(text)
        rest = text[end:].strip()
        lengths, end = decoder.raw_decode(rest) if rest else (None, 0)
    except ValueError as e:
        raise CLIError(f"{name}: {form} ({e.msg} at column {e.colno})", USAGE_ERROR) from None
    if rest[end:].strip():
        raise CLIError(f"{name}: unexpected text after the lists: {rest[end:].strip()[:40]!r}",
                       USAGE_ERROR)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        if isinstance(prompts, list) and all(isinstance(p, int) for p in prompts):
            raise CLIError(f"{name}: a max_tokens list must follow its prompts in the same "
                           """argument: '["p1", "p2"] [32, 64]'""", USAGE_ERROR)
        raise CLIError(f"{name}: {form}; the first list must hold strings", USAGE_ERROR)
    if lengths is not None:
        if not isinstance(lengths, list):
            raise CLIError(f"{name}: {form}; the second part must be a list", USAGE_ERROR)
        if len(lengths) != len(prompts):
            raise CLIError(f"{name}: {len(prompts)} prompts but {len(lengths)} max_tokens",
                           USAGE_ERROR)
    items = [{"prompt": p} for p in prompts]
    for item, n in zip(items, lengths or []):
        item["max_tokens"] = n
    return [_request(item, f"{name}, prompt {k}", default_max_tokens)
            for k, item in enumerate(items)]


def _request(item: dict, where: str, default_max_tokens: int) -> dict:
    unknown = sorted(set(item) - set(REQUEST_FIELDS))
    if unknown:
        raise CLIError(f"{where}: unknown field {unknown[0]!r} (allowed: "
                       f"{', '.join(REQUEST_FIELDS)})", USAGE_ERROR)
    item.setdefault("max_tokens", default_max_tokens)
    try:
        BatchItem.model_validate(item)
    except ValidationError as e:
        raise CLIError(f"{where}: {schema_error(e)}", USAGE_ERROR) from None
    if not item["prompt"]:  # the schema lets it through; the server refuses it later
        raise CLIError(f'{where}: "prompt" must be a non-empty string or list of token ids',
                       USAGE_ERROR)
    return item


def schema_error(e: ValidationError) -> str:
    """A pydantic error as one line naming the field: '"temperature" must be ..., got 5'."""
    errors = e.errors(include_url=False)
    # The deepest location is the most precise: for a prompt [1, "a"], "prompt[1]" must be
    # an integer says more than "prompt" must be a string.
    depth = max(len(err["loc"]) for err in errors)
    deepest = [err for err in errors if len(err["loc"]) == depth]
    err = deepest[0]
    field = _field_path(err["loc"])
    if err["type"] == "missing":
        return f'"{field}" is required'
    if not err["msg"].startswith("Input should be "):  # a validator's own message
        return f'"{field}": {err["msg"].removeprefix("Value error, ")}'
    # members of a union that all failed at the same place: "a valid string or a valid list"
    wanted = " or ".join(dict.fromkeys(_requirement(x) for x in deepest
                                       if _field_path(x["loc"]) == field))
    return f'"{field}" must be {wanted}, got {json.dumps(err["input"])[:40]}'


def _requirement(err: dict) -> str:
    ge = (err.get("ctx") or {}).get("ge")
    if err["type"] == "greater_than_equal" and ge == 1 and isinstance(err["input"], int):
        return "a positive integer"
    return err["msg"].removeprefix("Input should be ")


def _field_path(loc: tuple) -> str:
    # After the field name, pydantic's location holds list indices and the names of union
    # members ("str", "list[int]"), which are not part of what the user wrote.
    return str(loc[0]) + "".join(f"[{part}]" for part in loc[1:] if isinstance(part, int))
