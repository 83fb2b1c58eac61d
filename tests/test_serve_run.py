"""The user's command: `serve run serve_config.yaml`, one ready line, Ctrl-C leaves nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import yaml

from tests.serve_fixture import ROOT, free_port, wait_healthy

RAY_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "dashboard")


def ray_processes() -> set[int]:
    found = set()
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        text = " ".join([p.info["name"] or ""] + (p.info["cmdline"] or []))
        if any(m in text for m in RAY_PROCESS_MARKERS):
            found.add(p.info["pid"])
    return found


def test_serve_run_config_then_ctrl_c(tmp_path):
    before = ray_processes()
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    config_file = tmp_path / "serve_config.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen([serve_bin, "run", str(config_file)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url)
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 10
        while not any("orca-serve ready" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = [line for line in lines if "orca-serve ready" in line]
        assert len(ready) == 1 and f"http://127.0.0.1:{port}/v1" in ready[0]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends
        proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while ray_processes() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes() - before, "Ray processes left behind after Ctrl-C"
