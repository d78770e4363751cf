"""The shared store of one host: a tmpfs directory that every worker process of the host opens.

    {dir}/store-id                   a random id, written once by whoever came first: equal ids = one directory
    {dir}/pdserve-xfer-{ns}-{id}     one value per file (key ':' → '-'), mode 0600, written to a temporary name
                                     and renamed, so a reader never sees half of one
    {dir}/inbox-{id}.sock            a decode worker's inbox (the digest ending its key): a Unix stream socket it
                                     listens on; each prefill
                                     process keeps one connection to it and writes 4-byte length + record

The directory is created 0700: other users can neither read the KV nor write records. A value lives until its
reader takes it (read, then unlinked); `expire_old` drops what nobody took (the reader gave the request up, or
died), which the decode worker runs every so often. A record waits in the socket's buffer until the decode
worker reads it: a prefill worker that dies after its last record is still heard in full, then its connection's
end is (the `ended` callback), so the decode worker fails at once what that sender left unfinished.

A record longer than MAX_RECORD_BYTES ends its connection before anything is allocated for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.cache_store.shared_store import (
    MAX_RECORD_BYTES,
    Deliver,
    Ended,
    Listening,
    SharedStore,
    StoreError,
)

logger = logging.getLogger(__name__)
_LENGTH = struct.Struct(">I")
_KEY = re.compile(r"[A-Za-z0-9:_-]{1,200}")
_ID_FILE = "store-id"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, NUL included


class ShmStore(SharedStore):
    kind = "shm"
    orders_all_senders = False

    def __init__(self, directory: str, socket_timeout_s: float = 10.0) -> None:
        self.directory = Path(directory)
        probe = self._socket_path("pdserve:xfer:" + "0" * 16 + ":inbox:" + "0" * 32)  # the longest one
        if len(str(probe).encode()) > _MAX_SOCKET_PATH:
            raise StoreError(f"transfer store directory {directory!r} is too long for a Unix socket path "
                             f"({len(str(probe))} > {_MAX_SOCKET_PATH} bytes): choose a shorter one")
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            store_id = self._read_or_make_id()
        except OSError as exc:
            raise StoreError(f"cannot use {directory!r} as the transfer store: {exc}") from exc
        super().__init__(f"shm:{store_id}")
        self.socket_timeout_s = socket_timeout_s
        self._counter = itertools.count()
        self._connections: dict[str, socket.socket] = {}
        self._lock = threading.Lock()

    def _read_or_make_id(self) -> str:
        path = self.directory / _ID_FILE
        if not path.exists():
            temporary = self.directory / f".{_ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            temporary.write_text(secrets.token_hex(8))
            try:
                os.link(temporary, path)  # atomic: the first process's id wins, later ones read it
            except FileExistsError:
                pass
            finally:
                temporary.unlink()
        return path.read_text().strip()

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"store key {key[:80]!r} has characters other than letters, digits, ':', '_', '-'")
        return self.directory / key.replace(":", "-")

    def _socket_path(self, inbox: str) -> Path:
        """Short (a socket path holds 107 bytes): the digest that ends the inbox's key names it."""
        return self._path(inbox).with_name(f"inbox-{inbox.rsplit(':', 1)[-1]}.sock")

    # ---- values ---------------------------------------------------------------------------------------

    def put(self, key: str, parts: Sequence[bytes | memoryview], ttl_s: int) -> None:
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.tmp{os.getpid()}-{next(self._counter)}")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, parts)
            finally:
                os.close(fd)
            os.rename(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise StoreError(f"cannot write {path}: {exc}") from exc

    def take(self, key: str, nbytes: int) -> bytearray | None:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != nbytes:
                return None
            buffer = bytearray(nbytes)
            view, filled = memoryview(buffer), 0
            while filled < nbytes:
                got = os.readv(fd, [view[filled:]])
                if got == 0:
                    return None
                filled += got
            return buffer
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def expire_old(self, older_than_s: float) -> int:
        cutoff, dropped = time.time() - older_than_s, 0
        for entry in os.scandir(self.directory):
            if entry.name == _ID_FILE or entry.name.endswith(".sock") or not entry.name.startswith("pdserve-"):
                continue
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    dropped += 1
            except FileNotFoundError:
                continue
        return dropped

    # ---- records --------------------------------------------------------------------------------------

    def push(self, inbox: str, record: bytes, ttl_s: int) -> None:
        if len(record) > MAX_RECORD_BYTES:
            raise StoreError(f"a {len(record)}-byte record exceeds the {MAX_RECORD_BYTES}-byte limit")
        frame = _LENGTH.pack(len(record)) + record
        with self._lock:  # one writer per connection at a time: frames never interleave
            for attempt in (0, 1):  # a connection to a listener that restarted fails once: reconnect
                try:
                    self._connection(inbox).sendall(frame)
                    return
                except OSError as exc:
                    self._drop(inbox)
                    if attempt:
                        raise StoreError(f"no decode worker listens on {self._socket_path(inbox)}: {exc}") from exc

    def _connection(self, inbox: str) -> socket.socket:
        connection = self._connections.get(inbox)
        if connection is None:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.settimeout(self.socket_timeout_s)
            try:
                connection.connect(str(self._socket_path(inbox)))
            except OSError:
                connection.close()
                raise
            self._connections[inbox] = connection
        return connection

    def _drop(self, inbox: str) -> None:
        connection = self._connections.pop(inbox, None)
        if connection is not None:
            connection.close()

    async def listen(self, inbox: str, deliver: Deliver, ended: Ended) -> Listening:
        path = self._socket_path(inbox)
        path.unlink(missing_ok=True)
        listening = _ShmListening(path, deliver, ended)
        listening.server = await asyncio.start_unix_server(listening.serve, str(path))
        os.chmod(path, 0o600)
        return listening

    def close(self) -> None:
        with self._lock:
            for inbox in list(self._connections):
                self._drop(inbox)


class _ShmListening(Listening):
    def __init__(self, path: Path, deliver: Deliver, ended: Ended) -> None:
        self.path = path
        self.deliver = deliver
        self.ended = ended
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = object()  # this sender's stream
        self._writers.add(writer)
        try:
            while True:
                try:
                    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                except asyncio.IncompleteReadError:
                    return
                if not 0 < length <= MAX_RECORD_BYTES:
                    logger.warning("dropping a connection to %s: record of %d bytes (limit %d)", self.path, length,
                                   MAX_RECORD_BYTES)
                    return
                try:
                    record = await reader.readexactly(length)
                except asyncio.IncompleteReadError:
                    return
                self.deliver(record, source)
        except (ConnectionError, OSError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()
            self.ended(source)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self._writers):
            writer.close()
        if self.server is not None:
            await self.server.wait_closed()
        self.path.unlink(missing_ok=True)


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
