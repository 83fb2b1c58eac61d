"""The user's command (`make serve`: deployments.launch -> `serve run serve_config.yaml`):
one ready line, Ctrl-C leaves nothing behind, SIGTERM drains before it stops."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.serve_fixture import (ROOT, own_ports_env, start_long_stream, wait_healthy,
                                 write_config)


def session_processes(sessions: set[int]) -> set[int]:
    """The processes left in these sessions (the launcher's, and `serve run`'s with its
    Ray cluster's); other tests' Ray clusters may run beside, in sessions of their own."""
    found = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.info["pid"]) in sessions:
                found.add(p.info["pid"])
        except OSError:
            continue
    return found


def listener_name(port: int) -> str | None:
    """The name of the process listening on this TCP port."""
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid).name()
    return None


def as_background_job():
    """What a shell does to a command started with `&`: SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_server(tmp_path, preexec_fn=None, **args):
    """The launcher on serve_config.yaml with these args; (its process, the URL, the port,
    its output lines, the sessions of its processes)."""
    config_file, port = write_config(tmp_path, **args)
    proc = subprocess.Popen([sys.executable, "-m", "deployments.launch", str(config_file)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=preexec_fn,
                            env=own_ports_env())
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
    except TimeoutError:  # stop it (its drain stops serve run's processes), say what it said
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise TimeoutError(f"{url} not healthy; the launcher's last output:\n"
                           + "".join(lines[-40:])) from None
    serve_run = next(c for c in psutil.Process(proc.pid).children()
                     if "ray.serve.scripts" in c.cmdline())  # in a session of its own
    return proc, url, port, lines, {proc.pid, serve_run.pid}


def wait_gone(sessions: set[int], timeout=40.0):
    deadline = time.monotonic() + timeout
    while session_processes(sessions) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {}
    for pid in session_processes(sessions):
        try:  # (which session, and whose child: what the launcher's reap did not reach)
            p = psutil.Process(pid)
            left[pid] = (f"session {os.getsid(pid)}, parent {p.ppid()}, {p.status()}: "
                         + " ".join(p.cmdline())[:120])
        except (psutil.Error, OSError):
            continue  # (gone meanwhile)
    assert not left, f"processes left behind: {left}"


def test_serve_run_config_then_ctrl_c(tmp_path):
    proc, url, port, lines, sessions = start_server(tmp_path)
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 10
        while not any("orca-serve ready" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = [line for line in lines if "orca-serve ready" in line]
        assert len(ready) == 1 and f"http://127.0.0.1:{port}/v1" in ready[0]
        # the HTTP port is HAProxy's (deployments/serve_env.py), not Serve's Python proxy
        assert listener_name(port) == "haproxy"
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        proc.wait(timeout=60)
    # (Ray's dashboard and runtime-env agents were seen alive 40 s after the launcher had
    # ended, on a loaded 2-core machine; why is not known: the message says where they run)
    wait_gone(sessions, timeout=90.0)


def test_sigterm_drains_then_stops(tmp_path):
    """Also when started in the background, where `serve run` would inherit SIGINT ignored
    and never stop."""
    proc, url, _, lines, sessions = start_server(tmp_path, preexec_fn=as_background_job,
                                                 drain_timeout_s=2.0)
    events: list[dict] = []

    try:
        stream = start_long_stream(url, "keep going", events)
        time.sleep(2.0)  # the launcher has found the engine by now (at the ready line)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 1},
                         timeout=30).status_code != 503:
            assert time.monotonic() - sent < 1.0, \
                "new requests still accepted after SIGTERM:\n" + "".join(lines[-30:])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # draining: health and new requests say 503
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 503 and health.json().get("state") == "draining":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the engine never reported draining")
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "late"}, timeout=30)
        assert late.status_code == 503, late.text
        stream.join(timeout=30)
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # the launcher forwards Ctrl-C to `serve run`, in its session
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
    wait_gone(sessions)


def test_the_launcher_finds_the_cluster_that_its_serve_run_started():
    """Address "auto" finds the latest cluster started on this machine (another server, or
    a test beside this one): the launcher must drain the engines of its own."""
    from deployments.launch import cluster_address
    script = ("import sys, ray; ray.init(address='local', include_dashboard=False); "
              "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()")
    driver = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = driver.stdout.readline().strip()
        assert address and cluster_address(driver.pid) == address
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)
    deadline = time.monotonic() + 20  # its raylet may outlive the driver for a moment
    while cluster_address(driver.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster_address(driver.pid) is None


def test_serve_env_prints_shell_exports_of_every_setting():
    """`eval "$(python -m deployments.serve_env)"` before a plain `serve run`."""
    from deployments.serve_env import SERVE_ENV
    out = subprocess.run(["bash", "-c", 'eval "$(' + sys.executable + ' -m deployments.serve_env)"'
                          + " && env"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": os.environ.get("PATH", "")}, check=True).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV


def fake_engine(drained: list, alive: bool = True):
    """An engine's handle as the launcher uses it: stats (its first call) and drain."""
    from types import SimpleNamespace

    def drain(timeout_s):
        drained.append(timeout_s)
        return "drain" if alive else "died"
    return SimpleNamespace(stats=SimpleNamespace(remote=lambda: None),
                           drain=SimpleNamespace(remote=drain))


@pytest.mark.parametrize("successor", [True, False])
def test_sigterm_drains_the_engine_that_replaced_the_one_found(tmp_path, monkeypatch, capsys,
                                                              successor):
    """The launcher looks an engine up when it is ready (a SIGTERM then costs one call);
    if that engine has ended by the SIGTERM, the one running under its name is drained, and
    with none running there is nothing to drain (and nothing to complain about)."""
    import ray

    from deployments.launch import Drainer
    config_file, _ = write_config(tmp_path, drain_timeout_s=7.0)
    found, replacement = [], []
    lookups = [fake_engine(found, alive=False), fake_engine(replacement)]

    def get_actor(name, namespace):
        if not lookups or (not successor and len(lookups) == 1):
            raise ValueError(f"no actor {name}")
        return lookups.pop(0)

    def get(ref, timeout):
        if ref == "died":
            raise ray.exceptions.RayActorError()
        assert ref == "drain" and timeout > 7.0

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", get)
    drainer = Drainer(str(config_file))
    drainer.connected = True  # as after it connected to `serve run`'s cluster
    drainer.find_engines()
    drainer.drain()
    assert found == [7.0]
    assert replacement == ([7.0] if successor else [])
    assert "did not complete" not in capsys.readouterr().err


def test_what_serve_run_leaves_in_its_session_is_killed_after_a_grace():
    """The launcher's last step (deployments.launch.reap_session): a process that outlives
    `serve run` in its session (as Ray's agents were seen to), and its child, are killed."""
    from deployments.launch import reap_session
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; "
                               "time.sleep(120)']); time.sleep(120)"], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(session_processes({leader.pid})) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(session_processes({leader.pid})) == 2  # the leader and its child
    start = time.monotonic()
    reap_session(leader.pid, grace_s=0.5)
    assert leader.wait(timeout=10) == -signal.SIGKILL and time.monotonic() - start < 10
    wait_gone({leader.pid}, timeout=10)
