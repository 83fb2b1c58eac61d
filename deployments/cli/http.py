"""HTTP plumbing of the `orca-serve` CLI: the server's address and API key, one place that
turns transport failures and OpenAI error objects into a single readable line, and event
streams opened so that a refused request reads like any other refusal.

Every command goes through `server_errors` so that a server that is down, a route that
does not exist on an older server, or a rejected request all read the same way, whichever
command hit them.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource, ServerSentEvent, aconnect_sse, connect_sse

DEFAULT_URL = "http://127.0.0.1:8000"
DONE = "[DONE]"  # data of the event that ends an OpenAI-style stream


class CLIError(Exception):
    """A failure to report as one line on stderr, with the process exit status."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class Server:
    """Where requests go, and the API key sent with every one of them (if any)."""
    url: str
    api_key: str | None = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: httpx.Timeout | float) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self._headers())

    def async_client(self, timeout: httpx.Timeout | float) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout, headers=self._headers())


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
        if resp.status_code == 401:
            hint = " (give the server's key with --api-key or ORCA_SERVE_API_KEY)"
        elif resp.status_code == 404 and resp.request.url.path.startswith("/orca/"):
            hint = " (does this server have the batch API?)"
        raise CLIError(f"{what} was rejected: "
                       f"{error_message(resp.status_code, resp.content)}{hint}")


def json_body(resp: httpx.Response, what: str) -> dict:
    """The JSON object of a successful response, or a CLIError saying what came instead."""
    try:
        obj = resp.json()
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise CLIError(f"unexpected answer to {what}: {resp.text[:200]!r}")
    return obj


def event_json(sse: ServerSentEvent) -> dict:
    """The JSON object an event carries (every event but the final DONE carries one)."""
    try:
        obj = json.loads(sse.data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise CLIError(f"the server sent an unreadable event: {sse.data[:200]!r}")
    return obj


def _is_events(resp: httpx.Response) -> bool:
    # A refusal comes as a JSON error object, not as events; it must be read and reported
    # like any other refusal (httpx-sse would only say the content type is not events).
    return resp.status_code < 400 and "text/event-stream" in resp.headers.get("content-type", "")


def _refused(resp: httpx.Response, what: str) -> CLIError:
    check(resp, what)
    return CLIError(f"unexpected answer to {what}: {resp.text[:200]!r}")


@contextlib.contextmanager
def open_events(client: httpx.Client, method: str, path: str, what: str,
                **kwargs) -> Iterator[EventSource]:
    """An event stream whose response has been checked: a refusal raises a CLIError."""
    with connect_sse(client, method, path, **kwargs) as source:
        if not _is_events(source.response):
            source.response.read()
            raise _refused(source.response, what)
        yield source


@contextlib.asynccontextmanager
async def aopen_events(client: httpx.AsyncClient, method: str, path: str, what: str,
                       **kwargs) -> AsyncIterator[EventSource]:
    """`open_events` for an async client."""
    async with aconnect_sse(client, method, path, **kwargs) as source:
        if not _is_events(source.response):
            await source.response.aread()
            raise _refused(source.response, what)
        yield source
