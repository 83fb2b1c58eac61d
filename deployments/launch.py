"""`make serve`: run `serve run CONFIG` in the foreground, and shut it down gracefully.

    python -m deployments.launch [serve_config.yaml]

Ctrl-C is passed on to `serve run`, which shuts Serve and the local Ray instance down; what
that leaves running in its session is killed after REAP_GRACE_S.
SIGTERM (what a process supervisor sends) is handled here first: each application's engine
drains (new requests get 503, running ones get drain_timeout_s to finish, the rest end with
finish_reason "abort"), then `serve run` gets SIGINT and shuts everything down. `serve run`
alone would die on SIGTERM and cut every stream mid-way. It runs in its own session, so a
supervisor that signals this whole process group cannot kill it before the drain.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import yaml

from deployments import serve_env
from deployments.serve_run_stop import MARK, READY
from engine_actors.config import EngineConfig

# how often the launcher looks at things: it connects to `serve run`'s cluster once that is
# up, and lets go of it when a start failure is reported (the ingress, or the application's
# build, ends `serve run` 3 s after it logs that: deployments.serve_run_stop)
CONNECT_EVERY_S = 1.0
REAP_GRACE_S = 10.0  # what `serve run` leaves running gets this long to go (reap_session)
REAP_ROUNDS = 50  # then SIGKILL rounds, 0.1 s apart, until its session is empty
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# HAProxy's own words when a port it must listen on is taken (Serve's error then ends
# `serve run` after a traceback that buries them)
PORT_TAKEN = re.compile(r"cannot bind socket \(Address already in use\) for \[[^\]]*:(\d+)\]")


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (`serve run` and its Ray cluster: it runs in a
    session of its own; zombies are dead already); [] where /proc cannot say."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            if entry.isdigit() and os.getsid(int(entry)) == sid:
                with open(f"/proc/{entry}/stat", "rb") as f:  # (state: after the name)
                    if f.read().rpartition(b")")[2].split()[0] != b"Z":
                        pids.append(int(entry))
        except (OSError, IndexError):  # gone meanwhile
            continue
    return pids


def cluster_address(pid: int | None) -> str | None:
    """The GCS address of the Ray cluster that process `pid` started: its raylet runs in that
    process's session. None where /proc cannot say; "auto" then finds the latest cluster
    started on this machine, maybe another one."""
    for member in session_pids(pid) if pid is not None else ():
        try:
            with open(f"/proc/{member}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if os.path.basename(args[0]) == "raylet":
            return next((a.split("=", 1)[1] for a in args if a.startswith("--gcs-address=")),
                        None)
    return None


def reap_session(sid: int, grace_s: float = REAP_GRACE_S) -> None:
    """Once `serve run` has ended: what its Ray cluster left in its session gets grace_s to
    go, then SIGKILL, again until none is left (a raylet killed among them may have started
    an agent meanwhile). Under load, Ray's dashboard and runtime-env agents were seen to
    outlive their raylet by over 40 s."""
    deadline = time.monotonic() + grace_s
    while session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for _ in range(REAP_ROUNDS):
        left = session_pids(sid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                continue
        time.sleep(0.1)


class Drainer:
    """Asks the scheduler actor of every application in the config to drain. It connects to
    the Ray cluster of `serve run` as soon as that is up, and finds each engine as soon as it
    runs, so that a SIGTERM refuses new requests at once (connecting takes seconds, and the
    first call to an actor close to one)."""

    def __init__(self, config_path: str):
        with open(config_path) as f:
            self.apps = yaml.safe_load(f).get("applications", [])
        self.connected = False
        self.serve_run_pid: int | None = None
        self.engines: dict[str, tuple] = {}  # actor name: (handle, drain_timeout_s)

    def connect(self, quiet: bool = True) -> bool:
        """Connect to the cluster whose driver is our `serve run` (without /proc, address
        "auto" may name another local cluster, or a stale one, while ours is starting)."""
        import ray

        from engine_actors.scheduler_actor import NAMESPACE
        if self.connected:
            return True
        handler = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(address=cluster_address(self.serve_run_pid) or "auto",
                     namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
            jobs = ray._private.worker.global_worker.gcs_client.get_all_job_info()
            self.connected = any(j.driver_pid == self.serve_run_pid and not j.is_dead
                                 for j in jobs.values())
            if not self.connected:
                ray.shutdown()
                if not quiet:
                    print("orca-serve: the Ray cluster of `serve run` is not up: nothing to "
                          "drain", file=sys.stderr)
        except Exception as e:  # not up yet (or never came up)
            if not quiet:
                print(f"orca-serve: no Ray cluster to drain ({e})", file=sys.stderr)
        finally:
            signal.signal(signal.SIGTERM, handler)  # ray.init replaces it with an exit
        return self.connected

    def find_engines(self) -> None:
        """Look up the engines not found yet, and make a first (harmless) call to each: that
        call waits for Ray to reach the actor, so a drain later need not. Called when one
        says it is ready: a lookup while the cluster goes down would block for a minute."""
        import ray

        from engine_actors.scheduler_actor import NAMESPACE, actor_name
        for app in self.apps:
            cfg = EngineConfig.from_args(app.get("args"))
            for rank in range(cfg.data_parallel_size):
                name = actor_name(cfg, rank)
                if name in self.engines:
                    continue
                try:
                    actor = ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    continue  # this engine is not running (yet)
                actor.stats.remote()
                self.engines[name] = (actor, cfg.drain_timeout_s)

    def drain(self) -> None:
        import ray

        from engine_actors.scheduler_actor import NAMESPACE
        if not self.connect(quiet=False):
            return
        self.find_engines()
        drains = {name: actor.drain.remote(timeout_s)
                  for name, (actor, timeout_s) in self.engines.items()}
        for name, ref in drains.items():
            timeout_s = self.engines[name][1]
            try:
                try:
                    ray.get(ref, timeout=timeout_s + 10)
                except ray.exceptions.RayActorError:  # it ended since: drain its successor
                    actor = ray.get_actor(name, namespace=NAMESPACE)
                    ray.get(actor.drain.remote(timeout_s), timeout=timeout_s + 10)
            except ValueError:  # no successor: nothing to drain
                continue
            except Exception as e:
                print(f"orca-serve: drain did not complete: {e}", file=sys.stderr)

    def disconnect(self) -> None:
        """Before `serve run` takes the cluster down: a driver whose cluster dies is ended by
        Ray itself (the launcher would exit without a word)."""
        if self.connected:
            import ray
            self.engines.clear()  # handles first: ray.shutdown would wait for their actors
            ray.shutdown()
            self.connected = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = argv[0] if argv else "serve_config.yaml"
    drainer = Drainer(config)
    child: subprocess.Popen | None = None
    stopping = []

    def on_sigint(signum, frame):
        stopping.append(True)
        drainer.disconnect()
        if child is not None:
            child.send_signal(signal.SIGINT)

    def on_sigterm(signum, frame):
        if stopping or child is None:
            return
        stopping.append(True)
        print("orca-serve: SIGTERM: draining, then shutting down", file=sys.stderr)
        try:
            drainer.drain()
        except Exception as e:  # shut down anyway
            print(f"orca-serve: drain failed: {e}", file=sys.stderr)
        finally:
            drainer.disconnect()
            child.send_signal(signal.SIGINT)

    # Handlers first: a shell starts background jobs with SIGINT ignored, and an ignored
    # signal stays ignored across exec, so `serve run` would never stop. A caught one is
    # reset to its default in the child.
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigint)
    # `serve run` through this Python: the `serve` script is not on PATH in every install
    child = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", config],
                             start_new_session=True, stderr=subprocess.PIPE,
                             env=serve_env.apply(dict(os.environ)))
    drainer.serve_run_pid = child.pid
    failure: list[str] = []  # an engine start failure that `serve run` reported
    relayed = _Relay()
    relay = threading.Thread(target=relayed.copy, args=(child.stderr, failure), daemon=True)
    relay.start()
    try:
        while True:
            try:
                code = child.wait(timeout=CONNECT_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                if not (failure or stopping) and (drainer.connected or drainer.connect()) \
                        and relayed.ready.is_set():
                    relayed.ready.clear()
                    drainer.find_engines()
                # `serve run` is about to take its cluster down (a signal that came while
                # connecting left the connection made): let go of it, or Ray ends this process
                if failure or stopping:
                    drainer.disconnect()
            except InterruptedError:
                continue
    finally:
        try:
            drainer.disconnect()
        finally:
            reap_session(child.pid)
    relay.join(timeout=5)
    relayed.close()  # a process of the dying cluster may still hold the pipe open
    if code != 0 and relayed.taken_ports:  # the cause, as the last line
        print(f"orca-serve: HAProxy cannot listen on port {relayed.taken_ports[-1]}: another "
              "process holds it (another orca-serve or Ray Serve on this machine, or one "
              "left running). A second server on one machine needs its own "
              "http_options.port, RAY_SERVE_HAPROXY_STATS_PORT (8404) and "
              "RAY_SERVE_HAPROXY_METRICS_PORT (9101)", file=sys.stderr)
    elif code != 0 and failure:
        print(f"orca-serve: the engine failed to start: {failure[-1]}", file=sys.stderr)
    return code


class _Relay:
    """Copies `serve run`'s stderr to ours, noting engines that are ready, the cause of an
    engine start failure and the ports HAProxy found taken, until closed (then nothing more is written: the
    cause stays the last line)."""

    def __init__(self):
        self.lock, self.closed = threading.Lock(), False
        self.taken_ports: list[str] = []
        self.ready = threading.Event()  # an engine said it is ready

    def copy(self, stream, failure: list[str]) -> None:
        for raw in stream:
            line = ANSI.sub("", raw.decode(errors="replace"))
            with self.lock:
                if self.closed:
                    return
                sys.stderr.buffer.write(raw)
                sys.stderr.flush()
                if MARK in line:
                    cause = line.split(MARK, 1)[1].split(" [repeated ")[0].strip()
                    failure.append(cause)
                if READY in line:
                    self.ready.set()
                if taken := PORT_TAKEN.search(line):
                    self.taken_ports.append(taken.group(1))

    def close(self) -> None:
        with self.lock:
            self.closed = True


if __name__ == "__main__":
    sys.exit(main())
