"""Real uvicorn servers on loopback ports, each in its own thread and event loop."""

from __future__ import annotations

import socket
import threading
import time
from typing import Self

import uvicorn
from fastapi import FastAPI


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` at `server.url` until the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        """`host` may be any loopback address (127.0.0.2, ...: several servers on one port, as pods behind a
        headless Service); `port` 0 is any free one."""
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then; without it
        # every response written in two parts (headers, body) waits ~40 ms for a delayed ACK
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop listening and close idle connections; requests still running are cancelled after 1 s."""
        self.request_stop()
        self.join()

    def request_stop(self) -> None:
        self._server.should_exit = True

    def join(self) -> None:
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(servers: list[ServerThread]) -> None:
    """Stop several servers in parallel (each takes ~0.1 s to notice)."""
    for server in servers:
        server.request_stop()
    for server in servers:
        server.join()
