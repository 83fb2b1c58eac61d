"""The grammar that forces pythonic tool calls (Llama 3.2 1B/3B, Llama 4: the whole output
is a Python list of calls, `[get_weather(city='Oslo', days=2)]`), for tool_choice
"required" or a named function (structured.tool_grammar).

An xgrammar EBNF: each call names one of the forced functions and passes its parameters
as keyword arguments, in the order of the schema's `properties`: the required ones always,
the others optionally. A value is a Python literal of its parameter's type: a string (in
single or double quotes), an integer, a number, True/False, None, a list of its items'
type, a dict, or one of an `enum`'s values. An object with `properties` is a dict of those
keys in their order (the required ones always, the others optionally; no other keys), each
value of its own schema, to any depth; an object without them is any dict with string keys.
A parameter of another or no type (a type list, anyOf, $ref) takes any such literal. The
calls then parse (tool_formats.python_calls); their values follow the schema's types, not
its other constraints (lengths, ranges, patterns).
When max_tokens cuts forced calls, none come back: the list is not whole.
"""
from __future__ import annotations

import json
import keyword
import unicodedata

from deployments.protocol import APIError

WS = '" "?'  # at most one space after a separator: weak models loop on whitespace
LITERALS = r'''
str ::= "'" ([^'\\\n\r\0] | "\\" ["'\\nt])* "'" | "\"" ([^"\\\n\r\0] | "\\" ["'\\nt])* "\""
int ::= "-"? ("0" | [1-9] [0-9]*)
num ::= int ("." [0-9]+)? ([eE] [-+]? [0-9] [0-9]?)?
bool ::= "True" | "False"
none ::= "None"
any ::= str | num | bool | none | any_list | any_dict
any_list ::= "[" (any ("," WS any)*)? "]"
any_dict ::= "{" (str ":" WS any ("," WS str ":" WS any)*)? "}"
'''.replace("WS", WS)


def pythonic_grammar(tools, names: list[str], parallel: bool) -> str:
    """The EBNF of one call of any function in `names` (of `tools`), or with `parallel` one
    or more; APIError 400 for a name that Python cannot call."""
    rules, calls = [], []
    for tool in tools:
        name = tool.function.name
        if name not in names:
            continue
        if not _passable(name):
            raise APIError(400, f"tool {name!r} can not be called in the pythonic tool call "
                                "format (not a Python name): use tool_choice auto",
                           "tool_choice", "invalid_value")
        rule = f"call{len(calls)}"
        calls.append(rule)
        rules += _call_rules(rule, name, tool.function.parameters or {})
    one = " | ".join(calls)
    root = f'root ::= "[" call ("," {WS} call)* "]"' if parallel else 'root ::= "[" call "]"'
    return "\n".join([root, f"call ::= {one}", *rules]) + LITERALS


def _call_rules(rule: str, name: str, schema: dict) -> list[str]:
    """`name(k=v, ...)` with the schema's properties in order (the required ones always;
    an optional one that Python cannot pass by keyword is left out, a required one is a
    400)."""
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    required = {key for key in required if isinstance(key, str)}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    props = {key: prop for key, prop in props.items() if _passable(key) or key in required}
    for key in props:
        if not _passable(key):
            raise APIError(400, f"tool {name!r} has a required parameter {key!r}, which can "
                                "not be passed in the pythonic tool call format (not a Python "
                                "name): use tool_choice auto", "tool_choice", "invalid_value")
    rules = []
    for i, (key, prop) in enumerate(props.items()):
        rules += _value_rules(f"{rule}v{i}", prop if isinstance(prop, dict) else {})
    keys = [(f'"{key}="', key in required) for key in props]
    return [*rules, *_sequence_rules(rule, keys),
            f'{rule} ::= "{name}(" {rule}a01 ")"']


def _sequence_rules(rule: str, keys: list[tuple[str, bool]]) -> list[str]:
    """Rules `{rule}a01` for the comma-separated items `key value` (key: a terminal,
    value: the rule `{rule}v{i}`) in order, the required ones always, the others or not.
    a{i}{f}: the items from i on; f: none written yet (no comma before)."""
    rules, n = [], len(keys)
    for i, (key, required) in enumerate(keys):
        item = f"{key} {rule}v{i}"
        for first in (True, False):
            this = (item if first else f'"," {WS} {item}') + f" {rule}a{i + 1}0"
            rest = f"{rule}a{i + 1}{int(first)}"
            rules.append(f"{rule}a{i}{int(first)} ::= " +
                         (this if required else f"({this}) | {rest}"))
    return rules + [f'{rule}a{n}1 ::= ""', f'{rule}a{n}0 ::= ""']


def _value_rules(rule: str, schema: dict) -> list[str]:
    """A rule `rule` for a value of `schema`'s type (and rules it needs)."""
    if isinstance(schema.get("enum"), list):
        values = [_literal(v) for v in schema["enum"]]
        return [f"{rule} ::= " + " | ".join(json.dumps(v, ensure_ascii=False)
                                             for v in values if v is not None)
                if any(v is not None for v in values) else f"{rule} ::= any"]
    kind = schema.get("type")
    simple = {"string": "str", "integer": "int", "number": "num", "boolean": "bool",
              "null": "none", "object": "any_dict"}
    props = schema.get("properties")
    if kind == "object" and isinstance(props, dict) and props:
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        keys = [(json.dumps(repr(key) + ":", ensure_ascii=False) + f" {WS}", key in required)
                for key in props if isinstance(key, str)]
        values = [prop if isinstance(prop, dict) else {} for key, prop in props.items()
                  if isinstance(key, str)]
        return [f'{rule} ::= "{{" {rule}a01 "}}"', *_sequence_rules(rule, keys),
                *(r for i, value in enumerate(values) for r in _value_rules(f"{rule}v{i}", value))]
    if kind == "array":
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [f'{rule} ::= "[" ({rule}i ("," {WS} {rule}i)*)? "]"',
                *_value_rules(f"{rule}i", items)]
    return [f"{rule} ::= {simple.get(kind, 'any') if isinstance(kind, str) else 'any'}"]


def _passable(name: str) -> bool:
    """Can a function or keyword argument have this name, and keep it as Python reads it
    back (which normalizes names: NFKC)?"""
    return name.isidentifier() and not keyword.iskeyword(name) and \
        name not in ("None", "True", "False") and \
        unicodedata.normalize("NFKC", name) == name


def _literal(value) -> str | None:
    """An enum value as Python writes it (None: one Python and JSON do not share)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (str, int, float)):
        return repr(value)
    return None
