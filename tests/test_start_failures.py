"""An engine that cannot start ends `serve run` with a non-zero status and says why, within
a bounded time; while it starts, /health says "starting". (Which checkpoints are refused, and
with what message: tests/test_architectures.py, tests/test_checkpoint_files.py.)"""
from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.serve_fixture import ROOT, own_ports_env, write_config

TIME_LIMIT_S = 150


def serve_run(tmp_path, **args) -> tuple[subprocess.Popen, str, list[str]]:
    config_file, port = write_config(tmp_path, **args)
    proc = subprocess.Popen([sys.executable, "-m", "ray.serve.scripts", "run", str(config_file)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=own_ports_env())
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    return proc, f"http://127.0.0.1:{port}", stderr


def stop_markers() -> set[str]:
    """The files that serve_run_stop once wrote to /tmp (it writes them in Ray's session
    directory now, which goes with the cluster)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "orca-serve-stop-*")))


def ends_with_the_cause(proc, stderr: list[str], cause: str) -> None:
    try:
        code = proc.wait(timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"serve run still running after {TIME_LIMIT_S}s:\n" + "".join(stderr[-20:]))
    time.sleep(0.5)  # the reader thread takes the last lines
    assert code != 0
    # the end of the output: the cause, then Serve's teardown and the replica's last
    # /health access-log lines (how many depends on the machine's speed)
    tail = "".join(stderr[-60:])
    assert cause in tail, tail


def test_an_unplaceable_placement_group_ends_make_serve_with_the_cause_as_its_last_line(
        tmp_path):
    """`make serve` runs serve run through deployments.launch: serve run ends non-zero, its
    stderr (relayed) says why, and the launcher prints the cause last; while the engine
    starts, /health says "starting"."""
    markers = stop_markers()
    # 2 x 2 workers of one CPU each: more than this 2-CPU machine (and CI's) has
    config_file, port = write_config(tmp_path, tensor_parallel_size=2, pipeline_parallel_size=2,
                                     num_cpus_per_worker=1, placement_timeout_s=8)
    proc = subprocess.Popen([sys.executable, "-m", "deployments.launch", str(config_file)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=own_ports_env())
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    url, seen = f"http://127.0.0.1:{port}", set()
    deadline = time.monotonic() + TIME_LIMIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.add(httpx.get(f"{url}/health", timeout=5).json().get("status"))
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    ends_with_the_cause(proc, stderr, "was not placed within placement_timeout_s=8")
    reader.join(timeout=10)
    assert "starting" in seen
    assert "the cluster has CPU" in "".join(stderr[-60:])
    last = "".join(stderr).strip().splitlines()[-1]
    assert last.startswith("orca-serve: the engine failed to start: "), last
    assert "was not placed within placement_timeout_s=8" in last, last
    assert stop_markers() == markers  # nothing left in /tmp


def test_a_port_that_haproxy_finds_taken_is_named_last(tmp_path):
    """A second server on one machine (or one left running) holds HAProxy's statistics
    port: `make serve` ends, and its last line names the port and the settings to change
    (Serve's error would bury HAProxy's words in a traceback)."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        config_file, _ = write_config(tmp_path)
        proc = subprocess.Popen([sys.executable, "-m", "deployments.launch", str(config_file)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env={**own_ports_env(),
                                                "RAY_SERVE_HAPROXY_STATS_PORT": str(port)})
        stderr: list[str] = []
        reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        reader.start()
        ends_with_the_cause(proc, stderr, f"HAProxy cannot listen on port {port}")
    reader.join(timeout=10)
    last = "".join(stderr).strip().splitlines()[-1]
    assert last.startswith(f"orca-serve: HAProxy cannot listen on port {port}: "), last
    assert "RAY_SERVE_HAPROXY_STATS_PORT" in last


def test_an_unknown_arg_ends_serve_run_with_the_cause(tmp_path):
    """Serve builds the application in a task; its ConfigError used to leave `serve run`
    running forever (Serve only logs a failed build)."""
    markers = stop_markers()
    proc, _, stderr = serve_run(tmp_path, max_model_length=1024)
    ends_with_the_cause(proc, stderr, "ConfigError: unknown application args "
                                      "['max_model_length']")
    assert stop_markers() == markers  # nothing left in /tmp


def test_a_missing_model_is_named_as_the_cause():
    from engine_actors.checkpoint import resolve_model_path
    with pytest.raises(FileNotFoundError, match="is not a local checkpoint directory"):
        resolve_model_path("/nonexistent/no-such-model")


def test_start_failures_raised_in_a_worker_come_out_as_one_line_naming_the_cause():
    """What /health, the API's 503 and serve run's stderr say (executor.start_failure_cause):
    running out of device memory while profiling, or a kernel that does not compile, arrive
    wrapped in Ray's task error with its traceback; a worker that dies has no cause object."""
    import ray
    import torch

    from engine_actors.executor import start_failure_cause

    def raised_in_a_worker(error):
        try:
            raise error
        except Exception as e:
            return ray.exceptions.RayTaskError("Worker.num_kv_blocks", "Traceback ...\n", e)

    oom = raised_in_a_worker(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                    "2.00 GiB\nmore details"))
    assert start_failure_cause(oom) == ("OutOfMemoryError: CUDA out of memory. Tried to "
                                        "allocate 2.00 GiB")
    compile_error = raised_in_a_worker(RuntimeError("arange's range must be a power of 2"))
    assert start_failure_cause(compile_error) == \
        "RuntimeError: arange's range must be a power of 2"
    died = ray.exceptions.ActorDiedError()
    assert start_failure_cause(died).startswith("a worker died while starting: ")
