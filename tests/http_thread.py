"""An ASGI app served by uvicorn on a free local port in a background thread, for tests
that need a real HTTP server (streaming, disconnects) without a subprocess."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    """`with ServerThread(app) as url:` serves `app` at `url` until the block ends."""

    def __init__(self, app, lifespan: str = "off"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:  # set after the lifespan's start-up has run
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test HTTP server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
