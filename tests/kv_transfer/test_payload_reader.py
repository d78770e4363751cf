"""PayloadReader over real loopback sockets, on asyncio's loop and on uvloop: payloads land in the caller's buffer,
in stream order with the bytes read as a stream around them, and EOF and errors end a read as StreamReader's do."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import pytest

from pdserve.kv_transfer.payload_reader import PayloadReader, start_payload_server

Handler = Callable[[PayloadReader, asyncio.StreamWriter], Awaitable[None]]


async def serve_one(handler: Handler) -> tuple[asyncio.Server, int, asyncio.Future[None]]:
    """A server that runs `handler` on its first connection; the future ends with the handler."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def connected(reader: PayloadReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001  # the test reads it from the future
            done.set_exception(exc)
        finally:
            writer.close()

    server = await start_payload_server(connected, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], done


async def read_all_into(reader: PayloadReader, view: memoryview) -> int:
    filled = 0
    while filled < len(view):
        n = await reader.read_into(view[filled:])
        if not n:
            break
        filled += n
    return filled


async def connected_to(handler: Handler) -> tuple[asyncio.Server, asyncio.StreamWriter, asyncio.Future[None]]:
    server, port, done = await serve_one(handler)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    return server, writer, done


async def closing(server: asyncio.Server, writer: asyncio.StreamWriter) -> None:
    writer.close()
    server.close()
    await server.wait_closed()


async def exchange_payloads() -> None:
    """Four length-prefixed payloads and a trailer over one connection: each lands whole and in order, and most
    of each large one went from the socket straight into the caller's buffer, not through the stream buffer."""
    payloads = [os.urandom(n) for n in (5 << 20, 1, 300 << 10, 3 << 20)]
    got: list[bytes] = []
    direct = []

    async def handler(reader: PayloadReader, writer: asyncio.StreamWriter) -> None:
        for payload in payloads:
            assert await reader.readexactly(4) == len(payload).to_bytes(4, "big")
            buffer = bytearray(len(payload))
            before = reader.direct_bytes
            assert await read_all_into(reader, memoryview(buffer)) == len(payload)
            got.append(bytes(buffer))
            direct.append(reader.direct_bytes - before)
        assert await reader.readexactly(3) == b"end"
        assert await reader.read_into(memoryview(bytearray(8))) == 0, "EOF: nothing more"

    server, writer, done = await connected_to(handler)
    try:
        for i, payload in enumerate(payloads):
            writer.write(len(payload).to_bytes(4, "big"))
            # the first frame in one write (the reader buffers its start with the length), the others in pieces
            pieces = [payload] if i == 0 else [payload[j:j + (1 << 20)] for j in range(0, len(payload), 1 << 20)]
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)
        writer.write(b"end")
        writer.write_eof()
        await asyncio.wait_for(done, 30)
    finally:
        await closing(server, writer)
    assert got == payloads
    assert direct[0] > 0.8 * len(payloads[0]) and direct[3] > 0.8 * len(payloads[3]), direct


async def eof_inside_a_payload() -> None:
    """EOF inside a payload ends the read with what came."""
    seen: list[int] = []

    async def handler(reader: PayloadReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_all_into(reader, memoryview(bytearray(1 << 20))))

    server, writer, done = await connected_to(handler)
    try:
        writer.write(b"x" * 1000)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(done, 10)
    finally:
        await closing(server, writer)
    assert seen == [1000]


async def reset_while_waiting() -> None:
    """A reset connection ends the waiting read: 0 (EOF) or a ConnectionError, never a hang."""
    started = asyncio.Event()
    outcome: list[object] = []

    async def handler(reader: PayloadReader, writer: asyncio.StreamWriter) -> None:
        started.set()
        try:
            outcome.append(await reader.read_into(memoryview(bytearray(10))))  # waits: nothing was sent
        except ConnectionError as exc:
            outcome.append(exc)

    server, writer, done = await connected_to(handler)
    try:
        await started.wait()
        writer.transport.abort()  # RST
        await asyncio.wait_for(done, 10)
    finally:
        await closing(server, writer)
    assert outcome == [0] or isinstance(outcome[0], ConnectionError), outcome


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    return pytest.importorskip("uvloop").new_event_loop


# asyncio's own loop, and uvloop: uvicorn's default where it is installed (pdserve's dependencies have it), so the
# loop the workers' KV receivers run on
LOOPS = {"asyncio": lambda: asyncio.new_event_loop, "uvloop": uvloop_factory}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", [exchange_payloads, eof_inside_a_payload, reset_while_waiting],
                         ids=lambda case: case.__name__)
def test_payload_reader(loop: str, case: Callable[[], Awaitable[None]]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]()) as runner:
        runner.run(case())
