"""HTTP plumbing of the `orca-serve` CLI: one place that turns transport failures and
OpenAI error objects into a single readable line, and parses server-sent events.

Every command goes through `server_errors` so that a server that is down, a route that
does not exist on an older server, or a rejected request all read the same way, whichever
command hit them.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class CLIError(Exception):
    """A failure to report as one line on stderr, with the process exit status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def server_errors(url: str):
    """Map httpx transport errors raised inside the block to a CLIError naming `url`."""
    try:
        yield
    except httpx.ConnectError as e:
        reason = "connection refused" if "refused" in str(e).lower() else str(e) or type(e).__name__
        raise CLIError(f"cannot reach the orca-serve server at {url} ({reason}). Is it running "
                       "(`make serve`)? Point the CLI elsewhere with --url or ORCA_SERVE_URL.") from None
    except httpx.TimeoutException:
        raise CLIError(f"the server at {url} did not answer in time") from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise CLIError(f"the connection to {url} broke: {e or type(e).__name__}") from None


# C0/C1 control characters (a model can emit any byte, ESC sequences included) are shown as
# visible symbols on a terminal instead of being interpreted by it; newline and tab stay.
_CONTROL = {c: 0x2400 + c for c in range(32) if c not in (9, 10)} | {127: 0x2421}
_CONTROL |= {c: 0xFFFD for c in range(0x80, 0xA0)}


def printable(text: str) -> str:
    """`text` safe to write to a terminal."""
    return text.translate(_CONTROL)


def error_message(status: int, body: bytes) -> str:
    """The server's own message for a failed response (OpenAI error object), else the body."""
    try:
        err = json.loads(body)["error"]
        text = err["message"]
        if err.get("param"):
            text += f" (param: {err['param']})"
        return f"{text} [HTTP {status}]"
    except (ValueError, KeyError, TypeError):
        snippet = body.decode(errors="replace").strip()[:300]
        return f"HTTP {status}" + (f": {snippet}" if snippet else "")


def check(resp: httpx.Response, what: str) -> None:
    """Raise a CLIError quoting the server if `resp` failed; the body must already be read."""
    if resp.status_code >= 400:
        hint = ""
        if resp.status_code == 404 and resp.request.url.path.startswith("/orca/"):
            hint = " (does this server have the batch API?)"
        raise CLIError(f"{what} was rejected: {error_message(resp.status_code, resp.content)}{hint}")


def parse_sse_line(line: str) -> dict | str | None:
    """One line of an event stream: its JSON payload, "[DONE]", or None for other lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        return json.loads(data)
    except ValueError:
        raise CLIError(f"the server sent an unreadable event: {data[:200]!r}") from None


def json_body(resp: httpx.Response, what: str) -> dict:
    """The JSON object of a successful response, or a CLIError saying what came instead."""
    try:
        obj = resp.json()
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise CLIError(f"unexpected answer to {what}: {resp.text[:200]!r}")
    return obj


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """JSON payloads of `data:` lines, up to `data: [DONE]`; other SSE fields are skipped."""
    for line in lines:
        event = parse_sse_line(line)
        if event == "[DONE]":
            return
        if event is not None:
            yield event
