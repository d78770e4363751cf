"""Serving the router's app: one listener (http, or https with --ssl-keyfile / --ssl-certfile), and with TLS
optionally a second, plain-http one on 127.0.0.1 (`--internal-port`) for the workers on this host.

    clients ──https──▶ host:port ─────┐
                                      ├──▶ one app, one RouterState (the lifespan runs on the first listener)
    workers ──http───▶ 127.0.0.1:internal ┘

Why a second listener rather than workers speaking TLS to the router: `pdserve serve` addresses its children
by 127.0.0.1, which a certificate made for the host's public name does not cover, and the workers would need
the CA; the loopback listener is reachable from this host only, and /internal/* still needs PDSERVE_SECRET.

Under `pdserve serve` both sockets are the launcher's, inherited (--fd, --internal-fd: pdserve/listeners.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import uvicorn
from fastapi import FastAPI


@dataclass(frozen=True)
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    internal_port: int | None = None
    log_level: str = "info"
    fd: int | None = None  # an inherited socket already listening on host:port (pdserve/listeners.py)
    internal_fd: int | None = None  # the same for internal_port

    def __post_init__(self) -> None:
        for flag, port in (("--port", self.port), ("--internal-port", self.internal_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be in [0, 65535], got {port}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError(f"TLS needs both --ssl-keyfile and --ssl-certfile, got keyfile={self.ssl_keyfile} "
                             f"certfile={self.ssl_certfile}")
        if self.internal_port is not None and not self.tls:
            raise ValueError(f"--internal-port {self.internal_port} is the plain listener beside a TLS one: "
                             f"give --ssl-keyfile and --ssl-certfile, or drop it")
        if self.internal_fd is not None and self.internal_port is None:
            raise ValueError(f"--internal-fd {self.internal_fd} is the --internal-port listener's socket: give "
                             f"--internal-port too")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"


def _config(app: FastAPI, listen: ListenSettings, host: str, port: int, *, ssl_keyfile: str | None = None,
            ssl_certfile: str | None = None, lifespan: Literal["auto", "on", "off"] = "auto") -> uvicorn.Config:
    # uvicorn's own log lines at warning: pdserve logs what matters itself, and --log-level debug shows them
    level = "debug" if listen.log_level == "debug" else "warning"
    return uvicorn.Config(app, host=host, port=port, log_level=level, access_log=False, timeout_graceful_shutdown=3,
                          lifespan=lifespan, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)


class _Internal(uvicorn.Server):
    """The second listener: it leaves signals to the first, which stops it too."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Public(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, others: list[uvicorn.Server]) -> None:
        super().__init__(config)
        self.others = others

    def handle_exit(self, sig: int, frame: object) -> None:
        for other in self.others:
            other.should_exit = True
        super().handle_exit(sig, frame)  # type: ignore[arg-type]


def _inherited(fd: int | None) -> list[socket.socket] | None:
    """uvicorn's `sockets` for an inherited listening socket (None: uvicorn binds host:port itself)."""
    return None if fd is None else [socket.socket(fileno=fd)]


def serve_router(app: FastAPI, listen: ListenSettings) -> None:
    public_config = _config(app, listen, listen.host, listen.port, ssl_keyfile=listen.ssl_keyfile,
                            ssl_certfile=listen.ssl_certfile)
    if listen.internal_port is None:
        uvicorn.Server(public_config).run(sockets=_inherited(listen.fd))
        return
    internal = _Internal(_config(app, listen, "127.0.0.1", listen.internal_port, lifespan="off"))
    public = _Public(public_config, [internal])

    async def public_then_internal() -> None:
        try:
            await public.serve(sockets=_inherited(listen.fd))
        finally:  # however the public listener ends, the internal one follows
            internal.should_exit = True

    async def both() -> None:
        await asyncio.gather(public_then_internal(), internal.serve(sockets=_inherited(listen.internal_fd)))

    asyncio.run(both())
