"""Listening sockets: `bind_socket`, as a worker binds its HTTP port before its model loads (worker/app.py) and
as uvicorn binds one, and the routers' sockets, bound by `pdserve serve`'s launcher itself and inherited by every
start of each router (`pdserve router --fd N [--internal-fd M]`, pdserve/router_server.py), as systemd's socket
activation does.

    launcher: bind host:--port, listen ──fd──▶ pdserve router --fd N   (its first start, and every restart)

Why: the router's port is the one clients and workers know, so it cannot move, and a router that bound it
itself could lose it to another process twice: between the caller's choice of --port and the router's bind
at start, and while the launcher restarts a dead router. Held by the launcher, the port is taken from the
moment `pdserve serve` starts until it stops; one already in use fails the start at once, before any child
runs, with the address in the message. While a router is down, connections wait in the socket's backlog for
its restart instead of being refused.
"""

from __future__ import annotations

import socket
from dataclasses import replace

from pdserve.launch_plan import ChildSpec

_BACKLOG = 2048  # uvicorn's default


class ListenError(Exception):
    """An address cannot be listened on (in use, not this host's, or not an address at all)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, as uvicorn binds one (SO_REUSEADDR: a port whose last connections are in
    TIME_WAIT can be bound again; one another socket listens on cannot); uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen_on(host: str, port: int) -> socket.socket:
    """A router's socket, bound and listening now (connections wait in its backlog until a router serves it)."""
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(_BACKLOG)
    return sock


class RouterListeners:
    """The sockets of every router of one deployment, open from `bind` until `close`."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []

    def bind(self, spec: ChildSpec, host: str) -> ChildSpec:
        """A router's spec with its listeners bound and named on its command line (--fd, and with TLS
        --internal-fd for the plain loopback listener); any other child's as it is."""
        if spec.role != "router":
            return spec
        argv = list(spec.argv)
        listeners = (("--port", "--fd", host), ("--internal-port", "--internal-fd", "127.0.0.1"))
        for port_flag, fd_flag, address in listeners:
            if port_flag in argv:
                sock = listen_on(address, int(argv[argv.index(port_flag) + 1]))
                self.sockets.append(sock)
                argv += [fd_flag, str(sock.fileno())]
        return replace(spec, argv=argv)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()
