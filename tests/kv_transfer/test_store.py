"""The `store` backend in one process, over both stores: a tmpfs directory (shm) and a real redis-server.

Sender and receiver are built through the registry as a worker builds them; each test ends with the store
empty of this transfer's values (D took or deleted them)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.cache_store.shared_store import SharedStore, open_store
from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.registry import TransferEnv, get_backend
from pdserve.kv_transfer.store import StoreKVReceiver, StoreKVSender
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.wire import StoredKV

SECRET = "store-transfer-test"


@pytest.fixture(params=["shm", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_location(store_kind: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(directory, redis url) for the kind under test; Redis emptied before the test."""
    if store_kind == "shm":  # on tmpfs, as in production; a short path (a Unix socket's is at most 107 bytes)
        directory = tempfile.mkdtemp(prefix="pdserve-test-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        yield directory, ""
        shutil.rmtree(directory, ignore_errors=True)
        return
    server = request.getfixturevalue("redis_server")
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()
    yield "", server.url


def stored_values(kind: str, location: tuple[str, str]) -> list[str]:
    """Transfer values (not inboxes, not the store's id) left in the store."""
    if kind == "shm":
        return [p.name for p in Path(location[0]).iterdir() if "inbox" not in p.name and p.name != "store-id"]
    client = redis.Redis.from_url(location[1])
    try:
        return [k.decode() for k in client.keys("pdserve:xfer:*") if b"inbox" not in k and b"store-id" not in k]
    finally:
        client.close()


def make_store(kind: str, location: tuple[str, str]) -> SharedStore:
    return open_store(kind, location[0], location[1] or None)


@pytest.fixture
async def pair(store_kind: str, store_location: tuple[str, str],
               outcomes: Outcomes) -> AsyncIterator[tuple[StoreKVSender, StoreKVReceiver]]:
    backend = get_backend("store")
    d_env = TransferEnv(secret=SECRET, model_fingerprint="fp", store=make_store(store_kind, store_location))
    p_env = TransferEnv(secret=SECRET, model_fingerprint="fp", store=make_store(store_kind, store_location),
                        chunk_bytes=2 * 2 * 16 * 2 * 8 * 4)  # two blocks of one layer per value
    receiver = backend.build_receiver(d_env, make_pools(), outcomes.on_complete, outcomes.on_failure)
    sender = backend.build_sender(p_env, None)
    assert isinstance(receiver, StoreKVReceiver) and isinstance(sender, StoreKVSender)
    await receiver.start()
    yield sender, receiver
    await sender.close()
    await receiver.close()
    assert stored_values(store_kind, store_location) == []


async def push(sender: StoreKVSender, target: TransferTarget, pools: list[torch.Tensor], src: list[int],
               num_tokens: int) -> None:
    sender.begin(target)
    for layer in range(NUM_LAYERS):
        await sender.send_layer(target.request_id, layer, pools[layer], src, list(target.block_ids))
    await sender.finish(target.request_id, 11, -1.5, num_tokens, [(11, -1.5), (4, -2.25)])


async def test_round_trip_is_bit_exact_in_chunks(pair: tuple[StoreKVSender, StoreKVReceiver],
                                                 outcomes: Outcomes) -> None:
    sender, receiver = pair
    src = make_pools(random=True)
    target = receiver.expect("r1", [5, 2, 7], deadline=time.monotonic() + 10, num_tokens=40)
    assert target.backend == "store" and target.store == receiver.store.store_id and target.token
    await push(sender, target, src, [0, 3, 1], 40)  # 3 blocks a layer: two values of 2 and 1 blocks
    await outcomes.wait("r1")
    assert outcomes.completed == {"r1": (11, -1.5)} and outcomes.tops["r1"] == [(11, -1.5), (4, -2.25)]
    for layer, dst in enumerate(receiver.pools):
        assert torch.equal(dst[:, [5, 2, 7]], src[layer][:, [0, 3, 1]])
        assert not dst[:, [b for b in range(dst.shape[1]) if b not in (5, 2, 7)]].any()
    assert receiver.num_pending == 0 and not receiver._incoming


async def test_a_block_sent_twice_ends_with_its_second_copy(pair: tuple[StoreKVSender, StoreKVReceiver],
                                                            outcomes: Outcomes) -> None:
    """Chunked prefill: block 4 is half full after the first forward and complete after the second."""
    sender, receiver = pair
    first, second = make_pools(random=True, seed=1), make_pools(random=True, seed=2)
    target = receiver.expect("r1", [3, 4], deadline=time.monotonic() + 10)
    sender.begin(target)

    def compute_thread() -> None:
        for pools, src, dst in ((first, [0, 1], [3, 4]), (second, [1], [4])):
            for layer in range(NUM_LAYERS):
                sender.submit_layer("r1", layer, pools[layer], src, dst)

    await asyncio.to_thread(compute_thread)
    await sender.finish("r1", 3, None, 30)
    await outcomes.wait("r1")
    assert outcomes.completed == {"r1": (3, None)}
    for layer, dst in enumerate(receiver.pools):
        assert torch.equal(dst[:, 3], first[layer][:, 0]) and torch.equal(dst[:, 4], second[layer][:, 1])


async def test_a_forged_value_fails_the_request_and_writes_nothing(
        pair: tuple[StoreKVSender, StoreKVReceiver], outcomes: Outcomes) -> None:
    sender, receiver = pair
    target = receiver.expect("r1", [1], deadline=time.monotonic() + 10)
    sender.begin(target)
    original = receiver.store.take

    def tampered(key: str, nbytes: int) -> bytes | bytearray | None:  # someone with store access changed a byte
        value = original(key, nbytes)
        assert value is not None
        return bytes([value[0] ^ 1]) + bytes(value[1:])

    receiver.store.take = tampered  # type: ignore[method-assign]
    await sender.send_layer("r1", 0, make_pools(random=True)[0], [0], [1])
    await outcomes.wait("r1")
    assert "seal" in outcomes.failed["r1"] and not receiver.pools[0].any()
    await sender.abort("r1", "test over")


async def test_records_that_break_the_checks_fail_the_request(
        pair: tuple[StoreKVSender, StoreKVReceiver], outcomes: Outcomes) -> None:
    _, receiver = pair
    target = receiver.expect("r1", [1, 2], deadline=time.monotonic() + 10)
    seal = receiver.seal
    forged = seal.seal_record(receiver.inbox_key, StoredKV("r1", 0, [6], "float32", [2, 1, 16, 2, 8], 2048, 0, 0))
    unsealed = forged[:-1] + bytes([forged[-1] ^ 1])
    stranger = seal.seal_record(receiver.inbox_key, StoredKV("nobody", 0, [1], "float32", [2, 1, 16, 2, 8], 2048,
                                                             0, 0))
    for record in (unsealed, stranger):  # dropped, counted: the request is untouched
        receiver.store.push(receiver.inbox_key, record, 60)
    receiver.store.push(receiver.inbox_key, forged, 60)  # sealed, but block 6 is not reserved for r1
    await outcomes.wait("r1")
    assert "not reserved" in outcomes.failed["r1"] and receiver.num_bad_records == 2
    assert target.block_ids == (1, 2)


async def test_lease_and_abort_leave_nothing_in_the_store(pair: tuple[StoreKVSender, StoreKVReceiver],
                                                          outcomes: Outcomes) -> None:
    sender, receiver = pair
    pools = make_pools(random=True)
    target = receiver.expect("gone", [0, 1], deadline=time.monotonic() + 0.3)
    sender.begin(target)
    await sender.send_layer("gone", 0, pools[0], [0, 1], [0, 1])
    await outcomes.wait("gone")  # the other layers never come: the lease ends it
    assert "lease" in outcomes.failed["gone"]
    await sender.send_layer("gone", 1, pools[1], [0, 1], [0, 1])  # late: D deletes it on sight
    await sender.abort("gone", "gave up")
    late = receiver.expect("late", [2], deadline=time.monotonic() + 10)
    await push(sender, late, pools, [2], 10)  # the inbox still works after the late records
    await outcomes.wait("late")
    assert "late" in outcomes.completed


async def test_sender_lost_fails_a_transfer_without_done_and_keeps_a_complete_one(
        pair: tuple[StoreKVSender, StoreKVReceiver], outcomes: Outcomes, store_kind: str) -> None:
    sender, receiver = pair
    pools = make_pools(random=True)
    landed = receiver.expect("landed", [0], deadline=time.monotonic() + 10)
    await push(sender, landed, pools, [0], 10)
    receiver.sender_lost("landed", "P killed")  # its done came first: it completes
    half = receiver.expect("half", [1], deadline=time.monotonic() + 10)
    sender.begin(half)
    await sender.send_layer("half", 0, pools[0], [1], [1])
    if store_kind == "redis":
        receiver.sender_lost("half", "P killed")  # the marker comes after the layer: no done before it
    else:
        sender.store.close()  # shm: the sender's connection closing is how D hears of it
    await outcomes.wait("landed")
    await outcomes.wait("half")
    assert "landed" in outcomes.completed and "lost" in outcomes.failed["half"]
    assert torch.equal(receiver.pools[2][:, 0], pools[2][:, 0])


async def test_a_target_of_another_store_is_refused(pair: tuple[StoreKVSender, StoreKVReceiver]) -> None:
    _, receiver = pair
    target = receiver.expect("r1", [0], deadline=None)
    elsewhere = tempfile.mkdtemp(prefix="pdserve-test-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    other = StoreKVSender(open_store("shm", elsewhere, None))
    with pytest.raises(KVTransferError, match="give every worker the same --transfer-store"):
        other.begin(target)
    await other.close()
    shutil.rmtree(elsewhere)
    receiver.cancel("r1")
