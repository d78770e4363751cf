"""A stream reader that lands large payloads straight in the caller's buffer: the socket's `recv_into` writes
there, with no copy in user space.

asyncio's StreamReader copies every byte twice before the caller sees it (the transport's `recv` into a new
bytes object, then `feed_data` appends it to the reader's buffer; `read` then copies it out as bytes again,
and the caller copies those into its payload). For the tcp backend's KV frames (16 MiB a layer of Llama-3-8B)
that was 30 % of the receiving process's samples on the 2-core dev box (py-spy, benchmarks/transfer_backends.py).

    header bytes   socket ─recv_into─▶ scratch ─feed_data─▶ reader buffer ─readexactly─▶ caller   (as before)
    payload        socket ─recv_into─▶ caller's buffer (pinned host memory for a CUDA pool)      (read_into)

`PayloadProtocol` is a BufferedProtocol in front of asyncio's StreamReaderProtocol, so the transport asks it
for a buffer before each receive (CPython's selector transports and uvloop's alike): the caller's (what is left
of it) while `read_into` waits with nothing buffered, else a scratch buffer whose bytes are fed to the reader as
usual. So bytes already buffered are handed out
first and the order of the stream is kept. Everything else (readexactly, at_eof, the writer, flow control) is
the StreamReader's own. It reads the reader's buffer and wakes its waiter through StreamReader's internals
(`_buffer`, `_wait_for_data`, `_wakeup_waiter`, `_maybe_resume_transport`: unchanged since Python 3.8);
tests/kv_transfer/test_payload_reader.py covers them over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

_SCRATCH_BYTES = 256 << 10  # what asyncio's selector transports receive at once
_LIMIT = 64 << 10  # asyncio's default StreamReader limit


class PayloadReader(asyncio.StreamReader):
    if TYPE_CHECKING:  # StreamReader's internals this class uses (typeshed leaves them out)
        _buffer: bytearray
        _eof: bool
        _exception: BaseException | None

        async def _wait_for_data(self, func_name: str) -> None: ...
        def _wakeup_waiter(self) -> None: ...
        def _maybe_resume_transport(self) -> None: ...

    def __init__(self, limit: int = _LIMIT, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(limit=limit, loop=loop)
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._target: memoryview | None = None  # the buffer a waiting read_into gets the next bytes in
        self._landed = 0
        self._direct = False  # whether the last buffer handed to the transport was _target
        self.direct_bytes = 0  # bytes received straight into read_into's buffers

    async def read_into(self, view: memoryview) -> int:
        """Up to len(view) bytes of the stream into `view` (a writable byte view); how many; 0 at EOF. Bytes
        already buffered come first; with none, the next receive lands in `view` itself."""
        if not view:
            return 0
        if self._exception is not None:
            raise self._exception
        if not self._buffer and not self._eof:
            self._target, self._landed = view, 0
            try:
                await self._wait_for_data("read_into")
            finally:
                self._target = None
            if self._landed:
                return self._landed
        n = min(len(self._buffer), len(view))
        with memoryview(self._buffer) as buffered:
            view[:n] = buffered[:n]
        del self._buffer[:n]
        self._maybe_resume_transport()
        return n

    def receive_buffer(self) -> memoryview | bytearray:
        """Where the transport's next receive goes (PayloadProtocol.get_buffer)."""
        target = self._target
        self._direct = target is not None and not self._buffer and self._landed < len(target)
        if self._direct:
            assert target is not None
            return target[self._landed:]
        return self._scratch

    def received(self, nbytes: int) -> None:
        """The transport put `nbytes` into the buffer `receive_buffer` gave it."""
        if self._direct:
            self._landed += nbytes
            self.direct_bytes += nbytes
            self._wakeup_waiter()
        else:
            self.feed_data(memoryview(self._scratch)[:nbytes])


class PayloadProtocol(asyncio.BufferedProtocol):
    """A BufferedProtocol in front of asyncio's StreamReaderProtocol: the transport receives into the buffers
    the PayloadReader chooses; the rest (the writer, the client callback, flow control, EOF, loss) is the
    StreamReaderProtocol's. Not a subclass of it: uvloop, which the workers' servers run on, takes the buffered
    path only for a protocol that is not an asyncio.Protocol (CPython's transports test BufferedProtocol first)."""

    def __init__(self, reader: PayloadReader, connected: Callable[..., Awaitable[None]] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._reader = reader
        self._stream = asyncio.StreamReaderProtocol(reader, connected, loop=loop)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._stream.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stream.connection_lost(exc)

    def pause_writing(self) -> None:
        self._stream.pause_writing()

    def resume_writing(self) -> None:
        self._stream.resume_writing()

    def eof_received(self) -> bool | None:
        return self._stream.eof_received()

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        return self._reader.receive_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._reader.received(nbytes)


async def start_payload_server(connected: Callable[[PayloadReader, asyncio.StreamWriter], Awaitable[None]],
                               host: str, port: int) -> asyncio.Server:
    """asyncio.start_server, with a PayloadReader for each connection."""
    loop = asyncio.get_running_loop()

    def protocol() -> PayloadProtocol:
        return PayloadProtocol(PayloadReader(loop=loop), connected, loop=loop)

    return await loop.create_server(protocol, host, port)
