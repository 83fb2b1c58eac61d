"""Structured output and tool calls: from a request's fields to the grammar the engine
enforces (engine_actors/grammar.py), and the tool-call format of the served model.

Grammars: OpenAI's `response_format` (`json_object`, `json_schema`; vLLM's
`structural_tag`), or vLLM's extensions `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` (EBNF), or the same in `structured_outputs` (one of them per request). Tool calls: with
`tool_choice: "required"` the output is forced to be one or more calls (one with
`parallel_tool_calls: false`), with a named function one call of it, in the model family's
format (an xgrammar structural tag); with `"auto"` the model chooses and the text is parsed
afterwards (deployments/tool_parsers.py), only its first call kept with
`parallel_tool_calls: false`. With a reasoning parser, the grammar applies to the answer
after the model's reasoning (reasoning_grammar).
"""
from __future__ import annotations

import json
import re

from deployments.protocol import APIError
from deployments.reasoning import END, START
from deployments.pythonic_grammar import pythonic_grammar
from deployments.tool_parsers import CALL_SEPARATORS

MAX_JSON_DEPTH = 64  # objects and arrays nested in a schema (a level of properties is 2)
MAX_GRAMMAR_CHARS = 128 * 1024  # compiling takes ~2 ms per KB of schema on this CPU
# our parser name -> xgrammar's name of the same output format
XGRAMMAR_FORMATS = {"hermes": "qwen_3", "llama3_json": "llama", "qwen3_coder": "qwen_3_coder"}
# formats of ours without one: a forced call is `MARKER[{"name": ..., "arguments": {...}}]`
MARKER_FORMATS = {"mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>"}


def grammar_for(req, reasoning_parser: str | None = None,
                think_ids: tuple[int | None, int | None] = (None, None)
                ) -> tuple[str, str] | None:
    """The grammar spec a request asks for, checked (APIError 400 naming the field); with
    a reasoning parser, for the answer after the reasoning (reasoning_grammar)."""
    specs = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":  # OpenAI's JSON mode: an object
        specs.append(("response_format", ("json_schema", '{"type": "object"}')))
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema is required with type "
                                "json_schema", "response_format.json_schema",
                           "missing_required_parameter")
        specs.append(("response_format", ("json_schema", json.dumps(rf.json_schema.schema_))))
    if rf is not None and rf.type == "structural_tag":
        specs.append(("response_format", _tag_spec(rf.model_dump(by_alias=True),
                                                   "response_format")))
    elif rf is not None and (rf.format, rf.structures, rf.triggers) != (None, None, None):
        raise APIError(400, "response_format: format, structures and triggers go with type "
                            "structural_tag", "response_format", "invalid_value")
    kinds = ("json", "regex", "choice", "grammar")
    guided = [(f"guided_{kind}", kind, getattr(req, f"guided_{kind}")) for kind in kinds]
    so = req.structured_outputs  # vLLM's newer form of the guided_* fields
    if so is not None:
        guided += [(f"structured_outputs.{kind}", kind,
                    getattr(so, "json_" if kind == "json" else kind)) for kind in kinds]
        if so.json_object:
            specs.append(("structured_outputs.json_object", ("json_schema", '{"type": "object"}')))
        if so.structural_tag is not None:
            param = "structured_outputs.structural_tag"
            try:
                tag = json.loads(so.structural_tag)
            except (ValueError, RecursionError) as e:
                raise APIError(400, f"{param}: not JSON: {e}", param, "invalid_value") from None
            specs.append((param, _tag_spec(tag, param)))
    specs += [(param, _guided_spec(kind, value)) for param, kind, value in guided
              if value is not None]
    if len(specs) > 1:
        raise APIError(400, "only one of response_format, the guided_* fields and "
                            "structured_outputs' fields may be given", specs[1][0],
                       "invalid_value")
    if not specs:
        return None
    param, spec = specs[0]
    _check(spec, param)
    return reasoning_grammar(spec, reasoning_parser, param, think_ids) if reasoning_parser \
        else spec


def tool_grammar(tools, tool_choice, parser_name: str, parallel: bool = True,
                 reasoning_parser: str | None = None,
                 think_ids: tuple[int | None, int | None] = (None, None)) -> tuple[str, str]:
    """The grammar of a tool_choice that forces calls: with "required", one call of any of
    the tools, or with `parallel` one or more; with a named function, one call of it. In the
    format of `parser_name`, the arguments valid against the function's parameters, nothing
    else."""
    if parser_name == "pythonic":
        named = [tool_choice.function.name] if not isinstance(tool_choice, str) \
            else [t.function.name for t in tools]
        spec = ("ebnf", pythonic_grammar(tools, named, parallel and isinstance(tool_choice,
                                                                              str)))
        _check(spec, "tools")
        return reasoning_grammar(spec, reasoning_parser, "tools", think_ids) \
            if reasoning_parser else spec
    if parser_name not in XGRAMMAR_FORMATS and parser_name not in MARKER_FORMATS:
        what = "required" if tool_choice == "required" else "naming a function"
        raise APIError(400, f"tool_choice {what} is not supported with the {parser_name} "
                            "tool call format (no grammar forces it): use tool_choice auto",
                       "tool_choice", "invalid_value")
    named = [tool_choice.function.name] if not isinstance(tool_choice, str) \
        else [t.function.name for t in tools]
    tags = [_call_tag(parser_name, tool) for tool in tools if tool.function.name in named]
    if parallel and isinstance(tool_choice, str):
        fmt_json = {"type": "tags_with_separator", "tags": tags, "at_least_one": True,
                    "separator": CALL_SEPARATORS[parser_name], "stop_after_first": False}
    else:
        fmt_json = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    spec = ("structural_tag", json.dumps({"type": "structural_tag", "format": fmt_json}))
    _check(spec, "tools")
    return reasoning_grammar(spec, reasoning_parser, "tools", think_ids) if reasoning_parser \
        else spec


def _call_tag(parser_name: str, tool) -> dict:
    """The structural tag of one call of `tool` in the format of `parser_name`, its
    arguments valid against the function's parameters and whitespace bounded (weak models
    loop on it otherwise)."""
    if parser_name in MARKER_FORMATS:
        name = json.dumps(tool.function.name, ensure_ascii=False)
        schema = tool.function.parameters or {"type": "object"}
        return {"type": "tag", "begin": f'{MARKER_FORMATS[parser_name]}[{{"name": {name}, '
                                        '"arguments": ',
                "content": {"type": "json_schema", "json_schema": schema,
                            "max_whitespace_cnt": 1},
                "end": "}]"}
    import xgrammar as xgr
    choice = {"type": "function", "function": {"name": tool.function.name}}
    tag = xgr.get_model_structural_tag(XGRAMMAR_FORMATS[parser_name],
                                       tools=[tool.model_dump(by_alias=True)],
                                       tool_choice=choice, reasoning=False,
                                       max_whitespace_cnt=1)
    return tag.model_dump()["format"]


def reasoning_grammar(spec: tuple[str, str], parser: str, param: str | None = None,
                      think_ids: tuple[int | None, int | None] = (None, None)
                      ) -> tuple[str, str]:
    """The grammar of a reasoning model's whole output: its reasoning, any text up to
    </think> (with the qwen3 parser, only if it starts with <think>: thinking may be off),
    up to two newlines, then `spec` for the answer. With `param`, checked as the engine
    will compile it (APIError 400 naming `param`).

    With `think_ids`, the ids of <think> and </think> where each is one token
    (reasoning.think_token_ids), the engine masks nothing while the model thinks: a
    ("reasoning", ...) spec. Its grammar starts at the </think> token, as vLLM's does
    (an output that spells </think> in several tokens is then not held to `spec`); with
    qwen3 the whole grammar still masks the first token, which decides whether the
    output thinks at all."""
    from engine_actors.grammar import json_grammar
    kind, value = spec
    if kind == "structural_tag":
        answer = json.loads(value)["format"]
    elif kind == "regex":
        answer = {"type": "regex", "pattern": value}
    elif kind == "ebnf":
        answer = {"type": "grammar", "grammar": value}
    else:  # a JSON schema, by the engine's own rules (bounded whitespace, strict strings)
        answer = {"type": "grammar", "grammar": json_grammar(kind, value)}
    thinking = {"type": "tag", "begin": START if parser == "qwen3" else "",
                "content": {"type": "any_text", "excludes": [END]}, "end": END}
    if parser == "qwen3":
        thinking = {"type": "optional", "content": thinking}
    newlines = {"type": "regex", "pattern": "\\n{0,2}"}
    wrapped = _structural_tag({"type": "sequence", "elements": [thinking, newlines, answer]})
    if param is not None:
        _check(wrapped, param)
    start, end = think_ids
    if end is None or (parser == "qwen3" and start is None):
        return wrapped
    after = _structural_tag({"type": "sequence", "elements": [newlines, answer]})
    is_qwen3 = parser == "qwen3"
    return "reasoning", json.dumps({"end": end, "start": start if is_qwen3 else None,
                                    "first": list(wrapped) if is_qwen3 else None,
                                    "answer": list(after)})


def _tag_spec(tag, param: str) -> tuple[str, str]:
    """The grammar spec of vLLM's structural tag: xgrammar's `{"format": ...}`, or the older
    `{"structures": [{"begin", "schema", "end"}], "triggers"}`: any text, in which a
    trigger starts one of the structures that begin with it (xgrammar's triggered tags)."""
    if _depth(tag) > MAX_JSON_DEPTH:  # (before it is wrapped in more levels)
        raise APIError(400, f"{param}: the structural tag is nested more than "
                            f"{MAX_JSON_DEPTH} JSON levels deep", param, "invalid_value")
    if isinstance(tag, dict) and tag.get("format") is not None and (
            tag.get("structures") is not None or tag.get("triggers") is not None):
        raise APIError(400, f"{param}: a structural tag has `format`, or `structures` and "
                            "`triggers`, not both", param, "invalid_value")
    if isinstance(tag, dict) and isinstance(tag.get("format"), dict):
        return _structural_tag(tag["format"])
    if isinstance(tag, dict) and isinstance(tag.get("structures"), list) \
            and isinstance(tag.get("triggers"), list):
        try:
            tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema",
                                 "json_schema": True if s.get("schema") is None else s["schema"]}}
                    for s in tag["structures"]]
        except (TypeError, KeyError) as e:
            raise APIError(400, f"{param}: each structure needs begin, schema and end ({e!r})",
                           param, "invalid_value") from None
        return _structural_tag({"type": "triggered_tags", "triggers": tag["triggers"],
                                "tags": tags})
    raise APIError(400, f"{param}: a structural tag needs `format`, or `structures` and "
                        "`triggers`", param, "invalid_value")


def _structural_tag(fmt: dict) -> tuple[str, str]:
    return "structural_tag", json.dumps({"type": "structural_tag", "format": fmt})


def default_tool_parser(tokenizer, architecture: str) -> str:
    """The format of a model family: the chat template's own tags, else its architecture."""
    template = tokenizer.chat_template or ""
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|tool_call|>" in template:
        return "granite"
    return "llama3_json" if architecture == "LlamaForCausalLM" else "hermes"


def _guided_spec(kind: str, value) -> tuple[str, str]:
    """The grammar spec of a vLLM guided field (json, regex, choice or grammar)."""
    if kind == "json":
        return "json_schema", value if isinstance(value, str) else json.dumps(value)
    if kind == "choice":
        return "regex", f"({'|'.join(re.escape(c) for c in value)})"
    return ("regex", value) if kind == "regex" else ("ebnf", value)


def _check(spec: tuple[str, str], param: str) -> None:
    """Compiles the grammar (APIError 400 if it does not). A grammar over MAX_GRAMMAR_CHARS
    or a schema nested deeper than MAX_JSON_DEPTH is refused first: compiling grows with
    both (faster than the depth), and it runs on the replica's event loop and then on the
    engine's step loop."""
    from engine_actors.grammar import check_grammar
    if len(spec[1]) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"{param}: the grammar is over {MAX_GRAMMAR_CHARS} characters",
                       param, "invalid_value")
    if spec[0] in ("json_schema", "structural_tag"):
        try:
            value = json.loads(spec[1])
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"{param}: not a JSON schema: {e}", param,
                           "invalid_value") from None
        if _depth(value) > MAX_JSON_DEPTH:
            raise APIError(400, f"{param}: the schema is nested more than {MAX_JSON_DEPTH} "
                                "JSON levels deep", param, "invalid_value")
    try:
        check_grammar(spec)
    except ValueError as e:
        raise APIError(400, f"{param}: the grammar could not be compiled: {e}", param,
                       "invalid_value") from None


def _depth(value) -> int:
    """How deeply objects and arrays nest in a parsed JSON value."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else \
            item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest
