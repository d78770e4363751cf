"""The workers' side of the data plane (protocol/), spoken directly over a real connection (no router): reserve
until D is full (503 with retry_after), aborts that free at once, duplicate ids, P refusing a target that does
not fit, a malformed frame, a wrong secret, and a router connection that drops with requests on it."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest

from pdserve.protocol.codec import ProtocolError
from pdserve.protocol.connection import Connection, connect
from pdserve.protocol.framing import FrameLimits
from pdserve.protocol.messages import Abort, Error, Prefill, PrefillFailed, Refused, Reserve, Reserved
from tests.e2e.deployments import SECRET, Deployment

GREEDY = {"max_tokens": 4, "temperature": 0.0}


async def open_link(deployment: Deployment, role: str, secret: str | None = SECRET) -> Connection:
    host, port = deployment.data_address(role)
    connection, _ = await connect(host, port, secret, "e2e-test", FrameLimits())
    return connection


def reserve(request_id: str, num_tokens: int) -> Reserve:
    return Reserve(request_id, list(range(1000, 1000 + num_tokens)), GREEDY, None, time.time())


async def answer(connection: Connection) -> object:
    return await asyncio.wait_for(connection.recv(), 10)


async def wait_for_free(deployment: Deployment, blocks: int) -> None:
    deadline = time.monotonic() + 5
    while deployment.status("decode")["free_blocks"] != blocks:
        assert time.monotonic() < deadline, f"free blocks stayed {deployment.status('decode')['free_blocks']}"
        await asyncio.sleep(0.05)


async def test_reserve_until_full_then_abort_frees_everything(disaggregated: Deployment) -> None:
    free_before = disaggregated.status("decode")["free_blocks"]
    link = await open_link(disaggregated, "decode")
    reserved = []
    while True:
        link.send(reserve(f"fill-{len(reserved)}", 600))  # 38 blocks of 16 each
        reply = await answer(link)
        if not isinstance(reply, Reserved):
            break
        target = reply.transfer
        assert target["backend"] == "tcp" and len(target["block_ids"]) == 38 and target["port"] > 0
        reserved.append(reply.request_id)
    assert isinstance(reply, Refused) and reply.status == 503, reply
    assert reply.retry_after > 0 and "38 KV blocks needed" in reply.message
    assert len(reserved) == (free_before - 1) // 38  # one block is kept free for running requests to grow
    for request_id in reserved:
        link.send(Abort(request_id, "test"))
    link.send(Abort(reserved[0], "twice"))  # an id already freed is ignored
    await wait_for_free(disaggregated, free_before)
    link.close()


async def test_duplicate_ids_are_refused(disaggregated: Deployment) -> None:
    link = await open_link(disaggregated, "decode")
    link.send(reserve("twice", 20))
    assert isinstance(await answer(link), Reserved)
    link.send(reserve("twice", 20))
    duplicate = await answer(link)
    assert isinstance(duplicate, Refused) and duplicate.status == 409 and "already reserved" in duplicate.message
    link.send(Abort("twice", "test"))
    link.close()


async def test_prefill_refuses_a_target_it_cannot_fill(disaggregated: Deployment) -> None:
    decode, prefill = await open_link(disaggregated, "decode"), await open_link(disaggregated, "prefill")
    decode.send(reserve("mismatch", 40))  # 3 blocks
    target = (await answer(decode)).transfer
    prefill.send(Prefill("mismatch", list(range(1000, 1100)), GREEDY, None, target))  # 100 tokens need 7 blocks
    reply = await answer(prefill)
    assert isinstance(reply, PrefillFailed) and reply.status == 400 and "has 3 blocks" in reply.message
    prefill.send(Prefill("empty", [], GREEDY, None, target))
    empty = await answer(prefill)
    assert isinstance(empty, PrefillFailed) and empty.status == 400 and "empty" in empty.message
    decode.send(Abort("mismatch", "test"))
    decode.close()
    prefill.close()


async def test_a_malformed_frame_ends_that_connection_only(disaggregated: Deployment) -> None:
    broken, healthy = await open_link(disaggregated, "decode"), await open_link(disaggregated, "decode")
    broken.send_raw(struct.pack(">I", 3) + b"\x92\x0a\x01")  # [RESERVE, 1]: one field of five
    error = await answer(broken)
    assert isinstance(error, Error) and "Reserve" in error.message
    assert await answer(broken) is None  # closed by the worker
    broken.send_raw(struct.pack(">I", 1 << 30))  # 1 GiB claimed: refused before anything is read
    healthy.send(reserve("still-served", 20))
    assert isinstance(await answer(healthy), Reserved)
    healthy.send(Abort("still-served", "test"))
    healthy.close()


async def test_the_data_plane_needs_the_shared_secret(disaggregated: Deployment) -> None:
    for secret in ("wrong", None):
        with pytest.raises(ProtocolError, match="authentication failed"):
            await open_link(disaggregated, "decode", secret)


async def test_a_router_connection_lost_frees_its_requests(disaggregated: Deployment) -> None:
    free_before = disaggregated.status("decode")["free_blocks"]
    link = await open_link(disaggregated, "decode")
    for i in range(3):
        link.send(reserve(f"orphan-{i}", 100))
        assert isinstance(await answer(link), Reserved)
    assert disaggregated.status("decode")["free_blocks"] < free_before
    link.close()
    await wait_for_free(disaggregated, free_before)
