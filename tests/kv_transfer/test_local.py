from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.kv_transfer.base import KVTransferError
from pdserve.kv_transfer.local import LocalKVReceiver, LocalKVSender
from pdserve.kv_transfer.registry import get_backend


@pytest.fixture
def local(outcomes: Outcomes) -> tuple[LocalKVReceiver, LocalKVSender]:
    receiver = LocalKVReceiver(make_pools(random=True), outcomes.on_complete, outcomes.on_failure)
    return receiver, LocalKVSender(receiver)


async def test_send_is_only_a_signal(local: tuple[LocalKVReceiver, LocalKVSender], outcomes: Outcomes) -> None:
    receiver, sender = local
    before = [p.clone() for p in receiver.pools]
    target = receiver.expect("r1", [3, 5], deadline=None, num_tokens=20)
    assert target.backend == "local" and target.host is None
    sender.begin(target)
    for layer in range(NUM_LAYERS):
        await sender.send_layer("r1", layer, receiver.pools[layer], [3, 5], [3, 5])
    assert "r1" not in outcomes.completed
    await sender.finish("r1", 7, -0.5, 20)
    assert outcomes.completed == {"r1": (7, -0.5)} and receiver.num_pending == 0
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.pools))


async def test_other_source_blocks_are_copied_within_the_pool(
    local: tuple[LocalKVReceiver, LocalKVSender], outcomes: Outcomes
) -> None:
    receiver, sender = local
    sender.begin(receiver.expect("r1", [6, 7], deadline=None))
    futures = [sender.submit_layer("r1", layer, receiver.pools[layer], [0, 1], [6, 7]) for layer in range(NUM_LAYERS)]
    assert all(f.result() is None for f in futures)
    await sender.finish("r1", 1, None, 32)
    assert outcomes.completed == {"r1": (1, None)}
    for pool in receiver.pools:
        assert torch.equal(pool[:, [6, 7]], pool[:, [0, 1]])


async def test_errors(local: tuple[LocalKVReceiver, LocalKVSender], outcomes: Outcomes) -> None:
    receiver, sender = local
    sender.begin(receiver.expect("r1", [2], deadline=None))
    with pytest.raises(KVTransferError, match=r"blocks \[3\] are not reserved"):
        await sender.send_layer("r1", 0, receiver.pools[0], [3], [3])
    with pytest.raises(KVTransferError, match="not the shared pool"):
        await sender.send_layer("r1", 0, receiver.pools[0].clone(), [2], [2])
    assert sender.submit_layer("r1", 9, receiver.pools[0], [2], [2]).exception() is not None
    with pytest.raises(ValueError, match="already has a pending transfer"):
        receiver.expect("r1", [4], deadline=None)
    with pytest.raises(ValueError, match="outside the pool's 8 blocks"):
        receiver.expect("r2", [8], deadline=None)
    target3 = receiver.expect("r3", [4], deadline=None)
    receiver.expect("r4", [5], deadline=None)
    with pytest.raises(KVTransferError, match="not expected"):
        sender.begin(dataclasses.replace(target3, request_id="nope"))
    await sender.finish("r1", 1, None, 16)  # no layer arrived
    assert outcomes.failed["r1"].startswith("done before the KV was complete: layer 0 lacks blocks [2]")
    await sender.abort("r3", "prefill OOM")
    assert outcomes.failed["r3"] == "sender aborted: prefill OOM"
    assert receiver.cancel("r4") and not receiver.cancel("r4") and receiver.num_pending == 0
    assert "r4" not in outcomes.failed


async def test_lease_expiry_and_close(local: tuple[LocalKVReceiver, LocalKVSender], outcomes: Outcomes) -> None:
    receiver, sender = local
    receiver.expect("slow", [1], deadline=time.monotonic() + 0.05)
    receiver.expect("kept", [2], deadline=None)
    await outcomes.wait("slow", timeout_s=2)
    assert outcomes.failed["slow"].startswith("lease of 0.0")
    assert "expired (layer 0 lacks blocks [1])" in outcomes.failed["slow"]
    with pytest.raises(KVTransferError, match="no longer expected"):
        await sender.finish("slow", 1, None, 1)
    await receiver.close()
    assert outcomes.failed["kept"] == "receiver closed"
    await asyncio.sleep(0)


def test_registry() -> None:
    assert get_backend("local").sender is LocalKVSender
    with pytest.raises(ValueError, match=r"unknown KV transfer backend 'rdma'; choose one of \['cuda_ipc', 'local', 'nccl', 'store', 'tcp'\]"):
        get_backend("rdma")
