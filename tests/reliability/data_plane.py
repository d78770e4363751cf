"""Talking to one worker's data plane directly (protocol/), from synchronous tests: what the router would send."""

from __future__ import annotations

import asyncio
import time

from pdserve.protocol.connection import connect
from pdserve.protocol.framing import FrameLimits
from pdserve.protocol.messages import Message, Refused, Reserve, Reserved, TokenDelta, Tokens


def reserve_and_read(host: str, port: int, secret: str, reserve: Reserve,
                     timeout_s: float = 60.0) -> tuple[Reserved | Refused, list[TokenDelta], float]:
    """Reserve, send no KV, read the request's deltas to its last: (answer, deltas, seconds after reserving)."""
    return asyncio.run(_reserve_and_read(host, port, secret, reserve, timeout_s))


async def _reserve_and_read(host: str, port: int, secret: str, reserve: Reserve,
                            timeout_s: float) -> tuple[Reserved | Refused, list[TokenDelta], float]:
    connection, _ = await connect(host, port, secret, "reliability-test", FrameLimits())
    try:
        connection.send(reserve)
        answer = await asyncio.wait_for(connection.recv(), 10)
        assert isinstance(answer, Reserved | Refused), answer
        started, deltas = time.monotonic(), []
        async with asyncio.timeout(timeout_s):
            while isinstance(answer, Reserved) and not (deltas and deltas[-1].finish_reason is not None):
                message: Message | None = await connection.recv()
                assert isinstance(message, Tokens), message
                deltas += [d for d in message.deltas if d.request_id == reserve.request_id]
        return answer, deltas, time.monotonic() - started
    finally:
        connection.close()


def refuses_a_wrong_secret(host: str, port: int) -> bool:
    async def attempt() -> bool:
        try:
            connection, _ = await connect(host, port, "not-the-secret", "reliability-test", FrameLimits())
        except Exception as exc:  # noqa: BLE001 (the refusal is what we look for)
            return "authentication failed" in str(exc)
        connection.close()
        return False

    return asyncio.run(attempt())
