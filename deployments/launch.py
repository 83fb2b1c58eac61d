"""`make serve`: run `serve run CONFIG` in the foreground, and shut it down gracefully.

    python -m deployments.launch [serve_config.yaml]

Ctrl-C is passed on to `serve run`, which shuts Serve and the local Ray instance down.
SIGTERM (what a process supervisor sends) is handled here first: each application's engine
drains (new requests get 503, running ones get drain_timeout_s to finish, the rest end with
finish_reason "abort"), then `serve run` gets SIGINT and shuts everything down. `serve run`
alone would die on SIGTERM and cut every stream mid-way. It runs in its own session, so a
supervisor that signals this whole process group cannot kill it before the drain.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import yaml

from engine_actors.config import EngineConfig


def drain_engines(config_path: str) -> None:
    """Ask the scheduler actor of every application in the config to drain."""
    import ray

    from engine_actors.scheduler_actor import NAMESPACE, actor_name
    with open(config_path) as f:
        apps = yaml.safe_load(f).get("applications", [])
    try:
        ray.init(address="auto", namespace=NAMESPACE, logging_level="ERROR",
                 log_to_driver=False)
    except Exception as e:  # Serve never came up: nothing to drain
        print(f"orca-serve: no Ray cluster to drain ({e})", file=sys.stderr)
        return
    try:
        drains = []
        for app in apps:
            cfg = EngineConfig.from_args(app.get("args"))
            try:
                actor = ray.get_actor(actor_name(cfg), namespace=NAMESPACE)
            except ValueError:
                continue  # this application's engine is not running
            drains.append((actor.drain.remote(cfg.drain_timeout_s), cfg.drain_timeout_s))
        for ref, timeout_s in drains:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except Exception as e:
                print(f"orca-serve: drain did not complete: {e}", file=sys.stderr)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = argv[0] if argv else "serve_config.yaml"
    child: subprocess.Popen | None = None
    terminating = []

    def on_sigint(signum, frame):
        if child is not None:
            child.send_signal(signal.SIGINT)

    def on_sigterm(signum, frame):
        if terminating or child is None:
            return
        terminating.append(True)
        print("orca-serve: SIGTERM: draining, then shutting down", file=sys.stderr)
        try:
            drain_engines(config)
        except Exception as e:  # shut down anyway
            print(f"orca-serve: drain failed: {e}", file=sys.stderr)
        finally:
            child.send_signal(signal.SIGINT)

    # Handlers first: a shell starts background jobs with SIGINT ignored, and an ignored
    # signal stays ignored across exec, so `serve run` would never stop. A caught one is
    # reset to its default in the child.
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigint)
    # `serve run` through this Python: the `serve` script is not on PATH in every install
    child = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", config],
                             start_new_session=True)
    while True:
        try:
            return child.wait()
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
