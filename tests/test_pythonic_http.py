"""Forced pythonic tool calls through HTTP (a server with tool_call_parser: pythonic): the
grammar of deployments/pythonic_grammar.py writes the list of calls, and the answer is the
call alone, valid against the function's parameters, streamed or not."""
from __future__ import annotations

import json

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")

from tests.serve_fixture import wait_idle  # noqa: E402

pytestmark = pytest.mark.own_server  # its own server (conftest runs these modules last)

PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "urgent": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def url():
    from tests.serve_fixture import app_config, start_app, stop_app
    yield start_app(app_config(tool_call_parser="pythonic"))
    stop_app()


def test_forced_pythonic_calls_through_http(url):
    body = {"messages": [{"role": "user", "content": "pick a city"}], "max_tokens": 100,
            "temperature": 1.0, "tools": [PICK], "parallel_tool_calls": False}
    for seed, choice in enumerate(["required", {"type": "function",
                                                "function": {"name": "pick"}}] * 2):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={**body, "tool_choice": choice, "seed": seed})
        out = r.json()["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
        call = out["message"]["tool_calls"][0]["function"]
        assert call["name"] == "pick"
        jsonschema.validate(json.loads(call["arguments"]), PICK["function"]["parameters"])
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={**body, "tool_choice": "required", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "pick"
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    wait_idle(url)
