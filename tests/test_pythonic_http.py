"""Forced pythonic tool calls through HTTP (a server with tool_call_parser: pythonic): the
grammar of deployments/pythonic_grammar.py writes the list of calls, and the answer is the
call alone, valid against the function's parameters, streamed or not."""
from __future__ import annotations

import pytest

pytest.importorskip("jsonschema")

from tests.serve_fixture import wait_idle  # noqa: E402
from tests.test_structured_output import check_forced_calls  # noqa: E402

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
    deltas = check_forced_calls(url, rounds=2, tool=PICK)
    assert not any(d.get("content") for d in deltas)  # the list never leaks as text
    wait_idle(url)
