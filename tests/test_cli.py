"""The `orca-serve` CLI against a fake server (tests/fake_orca.py) that implements the batch
API and streaming chat with timings the test controls (no engine, no Ray).

The fake answers each request with its prompt upper-cased, after a delay set per batch, so
the expected output is known without running the code under test; a prompt "FAIL" fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from starlette.applications import Starlette

from deployments.cli.http import printable
from tests.cli_harness import run_cli
from tests.fake_orca import FakeOrca
from tests.http_thread import ServerThread

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake():
    server = FakeOrca(delays=[0.6, 0.05])
    with ServerThread(server.app) as url:
        server.url = url
        yield server


def test_batch_returns_at_once_with_ids(fake, tmp_path, monkeypatch):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "max_tokens": 5}\n\n"bare string"\n')
    code, out, err = run_cli(monkeypatch, "--url", fake.url, "batch", str(f))
    assert code == 0 and fake.polled == []  # it did not wait for the batch
    assert out.split() == list(fake.batches)
    assert fake.bodies == [{"requests": [{"prompt": "hello", "max_tokens": 5},
                                         {"prompt": "bare string", "max_tokens": 128}]}]
    assert f"orca-serve results {out.split()[0]}" in err


def test_wait_prints_each_batch_when_it_finishes(fake, tmp_path, monkeypatch):
    f = tmp_path / "slow.jsonl"
    f.write_text('{"prompt": "first"}\n{"prompt": "second", "temperature": 0.5}\n')
    code, out, err = run_cli(monkeypatch, "--url", fake.url, "batch", "--wait", "--priority",
                             "0", str(f), '["quick one"] [7]', tty=True)
    assert code == 0, err
    # The inline batch (submitted second) finishes first, and is printed first, whole.
    ids = list(fake.batches)
    assert out.index(f"=== {ids[1]}: completed, 1 ok") < out.index(f"=== {ids[0]}: completed")
    assert out.index("QUICK ONE") < out.index("FIRST") < out.index("SECOND")
    assert '--- [0] "quick one" (finish: length, 7 tokens)' in out
    assert fake.bodies[1] == {"requests": [{"prompt": "quick one", "max_tokens": 7}],
                              "priority": 0}
    assert "3/3" in err and "2/2 batches" in err  # the progress bar reached the end


def test_out_writes_grouped_jsonl_and_failures_set_the_exit_status(fake, tmp_path,
                                                                   monkeypatch):
    out_file = tmp_path / "res.jsonl"
    code, out, err = run_cli(monkeypatch, "--url", fake.url, "batch", "--out", str(out_file),
                             "--batch-size", "2", '["a", "FAIL", "c"]')
    assert code == 1 and "1 request(s) failed" in err
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    ids = list(fake.batches)
    assert len(ids) == 2 and [len(b["reqs"]) for b in fake.batches.values()] == [2, 1]
    # second batch (faster) first, then the first batch in index order
    assert [(r["batch_id"], r["index"]) for r in rows] == [(ids[1], 0), (ids[0], 0),
                                                           (ids[0], 1)]
    assert [r["text"] for r in rows] == ["C", "A", None]
    assert rows[2]["prompt"] == "FAIL" and rows[2]["error"]["message"] == "engine failed"
    assert out == ""


def test_status_cancel_and_results(fake, monkeypatch):
    code, out, _ = run_cli(monkeypatch, "--url", fake.url, "batch", '["x", "y"]')
    bid = out.strip()
    code, out, _ = run_cli(monkeypatch, "--url", fake.url, "status", bid)
    assert code == 0 and out.split() == [bid, "in_progress", "0/2", "finished,", "0", "failed"]
    code, out, _ = run_cli(monkeypatch, "--url", fake.url, "cancel", bid)
    assert out.split()[1] == "cancelled"
    code, out, err = run_cli(monkeypatch, "--url", fake.url, "results", bid)
    assert code == 1 and f"=== {bid}: cancelled, 0 ok, 2 failed" in out
    assert out.count("error: cancelled") == 2
    code, _, err = run_cli(monkeypatch, "--url", fake.url, "status", "batch-nope")
    assert code == 1 and "no batch batch-nope (param: id) [HTTP 404]" in err


@pytest.mark.parametrize("content, where", [
    ('{"prompt": "ok"}\n{"prompt": "ok"}\n{"prompt": "broken",\n', ":3: not valid JSON"),
    ('{"prompt": "ok"}\n[1, 2]\n', ":2: expected an object"),
    ('{"prompt": "ok", "max_token": 3}\n', ":1: unknown field 'max_token'"),
    ('{"prompt": "ok", "max_tokens": 0}\n', ":1: \"max_tokens\" must be a positive integer"),
    ('{"prompt": ""}\n', ":1: \"prompt\" must be a non-empty string"),
])
def test_malformed_file_names_the_line(fake, tmp_path, monkeypatch, content, where):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    code, out, err = run_cli(monkeypatch, "--url", fake.url, "batch", str(f))
    assert code == 2 and f"{f}{where}" in err and err.count("\n") == 1
    assert fake.bodies == []  # nothing was sent


def test_batch_lines_are_checked_with_the_server_schema(fake, tmp_path, monkeypatch):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [1, 2, 3]}\n{"prompt": "soon", "deadline_ms": 500, "top_k": 4}\n')
    code, out, err = run_cli(monkeypatch, "--url", fake.url, "batch", "--wait", str(f))
    assert code == 0, err
    # sent as written, plus the CLI's max_tokens (not every default of the schema)
    assert fake.bodies == [{"requests": [
        {"prompt": [1, 2, 3], "max_tokens": 128},
        {"prompt": "soon", "deadline_ms": 500, "top_k": 4, "max_tokens": 128}]}]
    assert "--- [0] [1, 2, 3] (finish: length, 128 tokens)\n1 2 3\n" in out
    assert "--- [1] \"soon\" (finish: length, 128 tokens)\nSOON" in out


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hot", "temperature": 5}',
     '"temperature" must be less than or equal to 2, got 5'),
    ('{"prompt": [1, "a"]}', '"prompt[1]" must be a valid integer, got "a"'),
    ('{"prompt": 7}', '"prompt" must be a valid string or a valid list, got 7'),
    ('{"max_tokens": 3}', '"prompt" is required'),
    ('{"prompt": [], "deadline_ms": 9}',
     '"prompt" must be a non-empty string or list of token ids'),
    ('{"prompt": "x", "stop": [""]}', '"stop": stop strings must have 1 to 512 characters'),
])
def test_values_the_server_would_refuse_fail_before_sending(fake, tmp_path, monkeypatch, line,
                                                            message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    code, _, err = run_cli(monkeypatch, "--url", fake.url, "batch", str(f))
    assert (code, err) == (2, f"orca-serve: {f}:2: {message}\n")
    assert fake.bodies == []


NO_KEY = {"ORCA_SERVE_API_KEY": None}


def test_api_key_from_the_option_or_the_environment(tmp_path, monkeypatch):
    server = FakeOrca(api_key="sekret")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    with ServerThread(server.app) as url:
        code, out, err = run_cli(monkeypatch, "--url", url, "batch", str(f), env=NO_KEY)
        assert code == 1 and out == "" and server.batches == {}
        assert err == (f"orca-serve: the batch from {f} was rejected: invalid or missing API "
                       "key (Authorization: Bearer, or x-api-key) [HTTP 401] (give the server's key with "
                       "--api-key or ORCA_SERVE_API_KEY)\n")
        # submit, the results stream and the status lookup all carry the key
        code, out, err = run_cli(monkeypatch, "--url", url, "batch", "--wait", str(f),
                                 env={"ORCA_SERVE_API_KEY": "sekret"})
        assert code == 0 and ": completed, 1 ok" in out and "\nHI" in out, err
        [bid] = server.batches
        code, out, err = run_cli(monkeypatch, "--url", url, "--api-key", "sekret", "status", bid,
                                 env={"ORCA_SERVE_API_KEY": "wrong"})  # the option wins
        assert code == 0 and out.split()[:2] == [bid, "completed"], err
        code, out, err = run_cli(monkeypatch, "--url", url, "chat", "--max-tokens", "2",
                                 stdin="hello\n", env={"ORCA_SERVE_API_KEY": "sekret"})
        assert code == 0 and "assistant> t0 t1 \n" in out, err
        code, out, err = run_cli(monkeypatch, "--url", url, "chat", stdin="hello\n", env=NO_KEY)
        assert code == 1 and "[HTTP 401]" in err and len(server.chat_streams) == 1


def test_server_options_before_or_after_the_command(tmp_path, monkeypatch):
    server = FakeOrca(api_key="k")
    f = tmp_path / "p.jsonl"
    f.write_text('"hi"\n')
    nowhere = "http://127.0.0.1:9"  # nothing listens there
    env = NO_KEY | {"ORCA_SERVE_URL": nowhere}
    with ServerThread(server.app) as url:
        code, _, err = run_cli(monkeypatch, "batch", str(f), "--url", url, "--api-key", "k",
                               env=env)
        assert code == 0 and len(server.batches) == 1, err
        # given before the command, and not overwritten by the command's own defaults
        code, _, err = run_cli(monkeypatch, "--url", url, "--api-key", "k", "batch", str(f),
                               env=env)
        assert code == 0 and len(server.batches) == 2, err
        code, out, err = run_cli(monkeypatch, "--api-key", "k", "chat", "--url", url,
                                 "--max-tokens", "1", stdin="hello\n", env=env)
        assert code == 0 and "assistant> t0 \n" in out, err
        # given on both sides: the one after the command wins
        code, _, err = run_cli(monkeypatch, "--url", nowhere, "--api-key", "x", "status",
                               next(iter(server.batches)), "--url", url, "--api-key", "k",
                               env=env)
        assert code == 0, err


@pytest.mark.parametrize("arg, message", [
    ('["a", "b"] [1]', "2 prompts but 1 max_tokens"),
    ('["a" "b"]', "expected [\"prompt 1\""),
    ("[3, 4]", "a max_tokens list must follow its prompts"),
    ('["a"] [2] extra', "unexpected text after the lists"),
])
def test_malformed_inline_batch(fake, monkeypatch, arg, message):
    code, _, err = run_cli(monkeypatch, "--url", fake.url, "batch", arg)
    assert code == 2 and message in err and fake.bodies == []


def test_rejected_batch_shows_the_server_message(fake, monkeypatch):
    code, _, err = run_cli(monkeypatch, "--url", fake.url, "batch", "--wait",
                           '["a"]', '["b"]', "--max-tokens", "3")
    assert code == 0  # two accepted batches: the rejection below is not a blanket one
    code, _, err = run_cli(monkeypatch, "--url", fake.url, "batch", "-",
                           stdin='{"prompt": "long", "max_tokens": 2046}\n')
    assert code == 1
    assert err.strip() == ("orca-serve: the batch from <stdin> was rejected: request 0: prompt "
                           "(3 tokens) + max_tokens (2046) exceeds the context length 2048 "
                           "(param: requests.0.max_tokens) [HTTP 400]")


@pytest.mark.parametrize("args", [["chat"], ["batch", '["a"]'], ["results", "batch-1"]])
def test_server_down_is_one_clear_line(monkeypatch, args):
    with ServerThread(Starlette()) as url:  # a port that was just free again
        pass
    code, out, err = run_cli(monkeypatch, "--url", url, *args)
    assert code == 1 and out == ""
    assert err == (f"orca-serve: cannot reach the orca-serve server at {url} (connection "
                   "refused). Is it running (`make serve`)? Point the CLI elsewhere with --url "
                   "or ORCA_SERVE_URL.\n")


def test_console_script_is_declared():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["orca-serve"] == "deployments.cli.main:main"
    env = dict(os.environ, ORCA_SERVE_URL="http://example.invalid:1")
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "--help"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "now: http://example.invalid:1" in proc.stdout


def test_model_output_cannot_drive_the_terminal():
    # ESC, CR, DEL and C1 controls become visible symbols; newline and tab stay as they are
    assert printable("a\x1b[2Jb\rc\n\td\x7f\x9b") == "a\u241b[2Jb\u240dc\n\td\u2421\ufffd"


@pytest.mark.parametrize("url", ["http://[::1", "http://256.1.1.1"])
def test_a_malformed_url_is_a_one_line_usage_error(monkeypatch, url):
    code, _, err = run_cli(monkeypatch, "--url", url, "status", "batch-x")
    assert code == 2 and "not a valid URL" in err and "Traceback" not in err


def test_status_of_a_cancelled_batch_counts_its_cancelled_requests():
    """`status` said "0/4 finished, 0 failed" where `results` said "4 failed"."""
    from deployments.cli.batch import status_line
    line = status_line({"id": "b1", "status": "cancelled", "num_requests": 4,
                        "num_completed": 1, "num_failed": 0, "num_cancelled": 3})
    assert line == "b1  cancelled  1/4 finished, 0 failed, 3 cancelled"
