"""The KV transfer wire spoken by hand over a blocking socket (kv_transfer/wire.py), to send what no
well-behaved sender would."""

from __future__ import annotations

import socket
import struct

import msgpack

from pdserve.kv_transfer.wire import WIRE_VERSION


def frame(header: dict) -> bytes:
    body = msgpack.packb({"version": WIRE_VERSION, "nbytes": 0, **header}, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def read_frame(sock: socket.socket) -> dict | None:
    """The next header, or None once the peer closed."""
    prefix = recv_exactly(sock, 4)
    if prefix is None:
        return None
    body = recv_exactly(sock, struct.unpack(">I", prefix)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
