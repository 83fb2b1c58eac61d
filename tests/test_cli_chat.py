"""`orca-serve chat` against the fake server (tests/fake_orca.py): streamed answers, the
conversation kept across turns, error events, and Ctrl-C in a real subprocess."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.cli_harness import run_cli
from tests.fake_orca import FakeOrca
from tests.http_thread import ServerThread

REPO = Path(__file__).resolve().parents[1]


def test_chat_error_event_is_shown_and_the_turn_dropped(monkeypatch):
    server = FakeOrca()
    with ServerThread(server.app) as url:
        code, out, err = run_cli(monkeypatch, "--url", url, "chat", "--max-tokens", "2",
                                 stdin="break please\nhello\n")
    assert code == 0 and "orca-serve: the answer failed: engine failed\n" in err
    assert out == "you> assistant> t0 \nyou> assistant> t0 t1 \nyou> "
    assert server.chat_streams[1]["body"]["messages"] == [{"role": "user", "content": "hello"}]


class _Child:
    """The CLI in a subprocess (Ctrl-C needs a real signal), its output collected as it comes."""

    def __init__(self, *args: str):
        # SIGINT handled as a terminal would, whatever this process inherited
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "deployments.cli", *args],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))
        self.out, self.err = [], []
        for stream, sink in [(self.proc.stdout, self.out), (self.proc.stderr, self.err)]:
            threading.Thread(target=lambda s=stream, k=sink: [k.append(c) for c in
                                                              iter(lambda: s.read(1), "")],
                             daemon=True).start()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, pred, what: str, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not pred("".join(self.out), "".join(self.err)):
            if time.monotonic() > end:
                raise AssertionError(f"no {what}; stdout={''.join(self.out)!r} "
                                     f"stderr={''.join(self.err)!r}")
            time.sleep(0.02)


def test_chat_streams_keeps_the_conversation_and_ctrl_c_cancels(monkeypatch):
    server = FakeOrca()
    with ServerThread(server.app) as url:
        child = _Child("--url", url, "chat", "--max-tokens", "3")
        # (stdout and stderr are read by two threads: the banner may arrive after the prompt)
        child.wait_for(lambda o, e: o.endswith("you> ") and "Chatting with fake-model" in e,
                       "prompt after the banner naming the model")
        child.send("hello")
        child.wait_for(lambda o, e: o.endswith("assistant> t0 t1 t2 \nyou> "), "first answer")
        child.send("slow one")
        child.wait_for(lambda o, e: o.endswith("assistant> t0 "), "streamed token")
        # Ctrl-C, again while the answer still streams if a loaded machine lost it (this
        # runs on 2 shared cores; a user would press it again too)
        for _ in range(3):
            child.proc.send_signal(signal.SIGINT)
            try:
                child.wait_for(lambda o, e: "[cancelled" in e, "cancellation", timeout=1.0)
                break
            except AssertionError:
                if not "".join(child.out).endswith("assistant> t0 "):
                    raise
        child.wait_for(lambda o, e: "[cancelled" in e and o.endswith("you> "), "cancellation")
        # the server saw the stream closed mid-answer
        assert server.chat_streams[1]["completed"] is False
        child.send("again")
        child.wait_for(lambda o, e: len(server.chat_streams) == 3 and o.endswith("you> "),
                       "third answer")
        assert server.chat_streams[2]["body"] == {
            "messages": [{"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "t0 t1 t2 "},
                         {"role": "user", "content": "again"}],
            "stream": True, "max_tokens": 3, "priority": 0}
        child.proc.stdin.close()  # Ctrl-D
        assert child.proc.wait(timeout=10) == 0

        child = _Child("--url", url, "chat")
        child.wait_for(lambda o, e: o.endswith("you> "), "prompt")
        child.proc.send_signal(signal.SIGINT)  # Ctrl-C on the empty prompt quits
        assert child.proc.wait(timeout=10) == 0


def test_chat_names_the_model_asked_for_and_refuses_one_not_served(monkeypatch):
    server = FakeOrca()
    with ServerThread(server.app) as url:
        code, _, err = run_cli(monkeypatch, "--url", url, "chat", "--model", "fake-model",
                               stdin="")
        assert code == 0 and "Chatting with fake-model" in err
        code, _, err = run_cli(monkeypatch, "--url", url, "chat", "--model", "bogus",
                               stdin="hello\n")
    assert code != 0 and "does not serve a model named 'bogus'" in err, err
    assert server.chat_streams == []  # refused before the first question
