"""`orca-serve chat`: an interactive conversation, streamed as the tokens arrive.

Chat requests carry `"priority": 0` (interactive; lower runs first, as in vLLM), so the
server schedules them ahead of batch work submitted with `orca-serve batch` (1). The
conversation is kept client-side and sent in full with every turn (the server is
stateless). Ctrl-C while an answer streams closes the HTTP stream, which makes the server
abort the request at once; the unfinished turn is then dropped from the conversation, so
the next question does not build on half an answer.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import httpx

from deployments.cli.http import (DONE, CLIError, Server, check, event_json, open_events,
                                  printable, server_errors)

PROMPT = "you> "
ANSWER_PREFIX = "assistant> "


@dataclass(frozen=True, slots=True)
class ChatOptions:
    model: str | None = None
    system: str | None = None
    max_tokens: int = 256
    temperature: float | None = None
    priority: int = 0


def run_chat(server: Server, opts: ChatOptions) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on every platform; input() still works without it
        readline = None
    # No read timeout while streaming: a long answer under load may pause between tokens.
    url = server.url
    with server.client(httpx.Timeout(30.0, read=None)) as client:
        model = _served_model(client, url, opts.model)
        print(f"Chatting with {model} at {url}. Ctrl-C stops an answer; Ctrl-C or Ctrl-D on "
              "an empty line (or /exit) quits; /reset forgets the conversation.",
              file=sys.stderr)
        start = [{"role": "system", "content": opts.system}] if opts.system else []
        history = list(start)
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print(file=sys.stderr)
                return 0
            except KeyboardInterrupt:
                # Like a shell: Ctrl-C discards a half-typed line, and quits on an empty one.
                if readline is not None and readline.get_line_buffer().strip():
                    print(file=sys.stderr)
                    continue
                print(file=sys.stderr)
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history = list(start)
                print("(conversation cleared)", file=sys.stderr)
                continue
            messages = history + [{"role": "user", "content": text}]
            try:
                answer = _stream_answer(client, url, messages, opts)
            except KeyboardInterrupt:
                print("\n[cancelled; this turn is not kept]", file=sys.stderr)
                continue
            except CLIError as e:  # shown, and the conversation goes on without this turn
                print(f"orca-serve: {e}", file=sys.stderr)
                continue
            history = messages + [{"role": "assistant", "content": answer}]


def _served_model(client: httpx.Client, url: str, wanted: str | None) -> str:
    """The model to chat with: `wanted` (a LoRA adapter, say) if the server lists it, else
    the one it serves. Also the first contact, so a server that is down, or a model it
    does not serve, is reported before the user types anything."""
    with server_errors(url):
        resp = client.get("/v1/models")
    check(resp, "listing the served models")
    try:
        listed = [m["id"] for m in resp.json()["data"]]
        first = listed[0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise CLIError(f"{url}/v1/models did not list a model; is this an orca-serve server?")
    if wanted is not None and wanted not in listed:
        raise CLIError(f"{url} does not serve a model named {wanted!r} (it serves: "
                       f"{', '.join(listed)})")
    return wanted or first


def _stream_answer(client: httpx.Client, url: str, messages: list[dict],
                   opts: ChatOptions) -> str:
    body: dict = {"messages": messages, "stream": True, "max_tokens": opts.max_tokens,
                  "priority": opts.priority}
    if opts.model is not None:
        body["model"] = opts.model
    if opts.temperature is not None:
        body["temperature"] = opts.temperature
    parts: list[str] = []
    out = sys.stdout
    is_tty = out.isatty()
    with server_errors(url), open_events(client, "POST", "/v1/chat/completions",
                                         "the message", json=body) as events:
        out.write(ANSWER_PREFIX)
        out.flush()
        try:
            for sse in events.iter_sse():
                if sse.data == DONE:
                    break
                event = event_json(sse)
                if "error" in event:
                    err = event["error"]
                    raise CLIError("the answer failed: "
                                   + (err.get("message", str(err)) if isinstance(err, dict)
                                      else str(err)))
                for choice in event.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        parts.append(delta)
                        out.write(printable(delta) if is_tty else delta)
                        out.flush()
        finally:
            out.write("\n")
            out.flush()
    return "".join(parts)
