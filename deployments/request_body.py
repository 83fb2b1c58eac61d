"""An HTTP body -> a validated request: strict UTF-8 JSON, no lone surrogates, and pydantic's
first error as an OpenAI-style 400 naming its param."""
from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import ValidationError

from deployments.protocol import APIError, _Base


def parse_body(raw: bytes, schema: type[_Base]) -> Any:
    """Bytes of an HTTP body -> a validated request, or APIError(400) naming the param."""
    try:  # strict UTF-8 (json.loads on bytes would pass encoded surrogates, or take UTF-16)
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", None, "invalid_encoding") from None
    except ValueError as e:
        if "integer string conversion" in str(e):  # (Python's limit: no JSON error)
            e = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        raise APIError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", None, "invalid_type")
    if "\\u" in text:  # only an escape can make a lone surrogate (strict UTF-8 cannot)
        check_unicode(data)
    try:
        req = schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    req.check_supported()
    return req


def validation_error(e: ValidationError, prefix: str | None = None) -> APIError:
    """APIError(400) for pydantic's first error, naming its param (under `prefix`, for a
    part of the body validated on its own)."""
    err = e.errors(include_url=False)[0]
    names = [prefix] if prefix else []
    names += [str(p) for p in err["loc"] if not _is_union_tag(p)]
    if err["type"] == "unsupported_parameter":  # a model's refusal of one of its fields
        names.append(err["ctx"]["name"])
    param = ".".join(names) or None
    code = {"missing": "missing_required_parameter",
            "unsupported_parameter": "unsupported_parameter"}.get(err["type"], "invalid_value")
    return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param, code)


def check_unicode(data) -> None:
    """APIError(400) if a string of parsed JSON holds a lone UTF-16 surrogate ("\\ud800"):
    JSON's escapes allow one, but it is not Unicode text, and tokenizers reject it."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "a string holds a lone UTF-16 surrogate escape (such as "
                                    "\\ud800), which is not valid Unicode", None,
                               "invalid_encoding") from None


def _is_union_tag(loc_part) -> bool:
    """pydantic names union members in error locations ('str', 'list[int]'); OpenAI does not."""
    return isinstance(loc_part, str) and (loc_part in {"str", "int", "float", "bool"}
                                          or "[" in loc_part or loc_part.endswith("Part")
                                          or loc_part.startswith("constrained-"))
