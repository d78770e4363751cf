from __future__ import annotations

import asyncio
import pathlib
import pickle
import re
import threading
import time

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools, start_receiver

import pdserve.kv_transfer
from pdserve.kv_transfer.base import ChunkSend, KVTransferError
from pdserve.kv_transfer.target import TransferTarget
from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender


async def push(
    sender: TcpKVSender, target: TransferTarget, pools: list[torch.Tensor], src: list[int], num_tokens: int = 20
) -> None:
    sender.begin(target)
    for layer in range(NUM_LAYERS):
        await sender.send_layer(target.request_id, layer, pools[layer], src, list(target.block_ids))
    await sender.finish(target.request_id, 11, -1.5, num_tokens, [(11, -1.5), (4, -2.25)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
async def test_round_trip_is_bit_exact(dtype: torch.dtype, outcomes: Outcomes) -> None:
    receiver = await start_receiver(outcomes, dtype)
    sender = TcpKVSender()
    src_pools = make_pools(dtype, random=True)
    try:
        target = receiver.expect("r1", [5, 2], deadline=time.monotonic() + 10, num_tokens=20)
        await push(sender, target, src_pools, [0, 3])
        await outcomes.wait("r1")
    finally:
        await sender.close()
        await receiver.close()
    assert outcomes.completed == {"r1": (11, -1.5)} and outcomes.tops["r1"] == [(11, -1.5), (4, -2.25)]
    for src, dst in zip(src_pools, receiver.pools):
        assert torch.equal(dst[:, [5, 2]].view(torch.uint8), src[:, [0, 3]].view(torch.uint8))
        untouched = [b for b in range(dst.shape[1]) if b not in (5, 2)]
        assert not dst[:, untouched].any()


async def test_layers_arrive_in_chunks_and_from_a_compute_thread(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    sender = TcpKVSender()
    src_pools = make_pools(random=True)
    target = receiver.expect("r1", [1, 4, 6], deadline=time.monotonic() + 10)
    sender.begin(target)

    def compute_thread() -> list:
        futures = []
        for chunk_src, chunk_dst in (([0, 1], [1, 4]), ([2], [6])):  # chunked prefill: two chunks
            for layer in range(NUM_LAYERS):
                futures.append(sender.submit_layer("r1", layer, src_pools[layer], chunk_src, chunk_dst))
        return futures

    futures = await asyncio.to_thread(compute_thread)
    await sender.finish("r1", 3, None, 40)  # waits for every submitted layer itself
    # each future is the wrapper run_coroutine_threadsafe made: it completes a loop turn after its send, which
    # finish may not have given up yet (Python 3.12 on the H100 host)
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), 5)
    await outcomes.wait("r1")
    assert outcomes.completed == {"r1": (3, None)}
    for src, dst in zip(src_pools, receiver.pools):
        assert torch.equal(dst[:, [1, 4, 6]], src[:, [0, 1, 2]])
    await sender.close()


async def test_connection_is_reused_and_reopened(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    sender = TcpKVSender()
    pools = make_pools(random=True)
    await push(sender, receiver.expect("a", [0], deadline=None), pools, [0], num_tokens=5)
    (first,) = sender.links.connections.values()
    await push(sender, receiver.expect("b", [1], deadline=None), pools, [1], num_tokens=5)
    assert list(sender.links.connections.values()) == [first], "one connection per receiver"
    # A frame for a request the receiver never reserved makes it drop the connection...
    stray = TransferTarget("tcp", "stray", (2,), NUM_LAYERS, 16, "float32", "127.0.0.1", receiver.port)
    sender.begin(stray)
    await sender.abort("stray", "test")
    async with asyncio.timeout(2):
        while first.usable():
            await asyncio.sleep(0.01)
    # ...and the next transfer reconnects.
    await push(sender, receiver.expect("c", [2], deadline=None), pools, [2], num_tokens=5)
    await outcomes.wait("c")
    assert set(outcomes.completed) == {"a", "b", "c"} and not outcomes.failed
    await sender.close()


async def test_frames_of_an_ended_request_do_not_cost_the_connection(
    receiver: TcpKVReceiver, outcomes: Outcomes
) -> None:
    """D cancels (client gone) while P is still sending: the rest is discarded, the connection lives."""
    sender = TcpKVSender()
    pools = make_pools(random=True)
    sender.begin(receiver.expect("gone", [0], deadline=None))
    sender.begin(receiver.expect("kept", [1], deadline=None))
    await sender.send_layer("gone", 0, pools[0], [0], [0])
    assert receiver.cancel("gone")
    for layer in range(NUM_LAYERS):
        await sender.send_layer("gone", layer, pools[layer], [0], [0])
        await sender.send_layer("kept", layer, pools[layer], [1], [1])
    await sender.finish("gone", 1, None, 16)
    await sender.finish("kept", 2, None, 16)
    await outcomes.wait("kept")
    assert outcomes.completed == {"kept": (2, None)} and not outcomes.failed
    assert not receiver.pools[1][:, 0].any(), "a cancelled request's later frames are not written"
    (connection,) = sender.links.connections.values()
    assert connection.usable()
    await sender.close()


async def test_shared_secret(outcomes: Outcomes) -> None:
    receiver = await start_receiver(outcomes, secret="s3cret")
    pools = make_pools(random=True)
    intruder = TcpKVSender(secret="guess")
    good = TcpKVSender(secret="s3cret")
    try:
        target = receiver.expect("r1", [3], deadline=None)
        intruder.begin(target)
        with pytest.raises(KVTransferError, match="refused the connection: authentication failed"):
            await intruder.send_layer("r1", 0, pools[0], [3], [3])
        assert not receiver.pools[0].any(), "nothing from an unauthenticated peer was written"
        assert receiver.num_pending == 1 and not outcomes.failed
        await push(good, target, pools, [3], num_tokens=16)
        await outcomes.wait("r1")
        assert "r1" in outcomes.completed
    finally:
        await intruder.close()
        await good.close()
        await receiver.close()


async def test_lease_expires_mid_transfer(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    sender = TcpKVSender()
    pools = make_pools(random=True)
    target = receiver.expect("r1", [0, 1], deadline=time.monotonic() + 0.2)
    sender.begin(target)
    await sender.send_layer("r1", 0, pools[0], [0, 1], [0, 1])
    await outcomes.wait("r1", timeout_s=3)
    assert outcomes.failed["r1"].startswith("lease of 0.")
    assert "layer 1 lacks blocks [0, 1]" in outcomes.failed["r1"]
    await sender.close()


async def test_abort_and_early_done(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    sender = TcpKVSender()
    pools = make_pools(random=True)
    sender.begin(receiver.expect("gave-up", [0], deadline=None))
    await sender.abort("gave-up", "client disconnected")
    sender.begin(receiver.expect("early", [1], deadline=None))
    await sender.send_layer("early", 0, pools[0], [1], [1])
    await sender.finish("early", 1, None, 16)
    await outcomes.wait("early")
    assert outcomes.failed == {
        "gave-up": "sender gave up: client disconnected",
        "early": "done before the KV was complete: layer 1 lacks blocks [1]",
    }
    await sender.close()


async def test_prepared_sends_check_once_and_move_ids_once(
    receiver: TcpKVReceiver, outcomes: Outcomes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One forward's chunks, prepared once and pushed per layer from a compute thread: a chunk with an
    unreserved block fails at once, a good one arrives whole, each chunk's ids are made once (not per layer);
    a layer the target does not have fails the request from there on."""
    from pdserve.kv_transfer import staging

    made: list[tuple[int, ...]] = []  # id lists turned into tensors (a tensor passed in is used as it is)
    real_ids_on = staging.ids_on

    def ids_on(device: torch.device, ids: object) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            made.append(tuple(ids))
        return real_ids_on(device, ids)

    monkeypatch.setattr(staging, "ids_on", ids_on)
    sender = TcpKVSender()
    src_pools = make_pools(random=True)
    for rid, blocks in (("good", [1, 4]), ("bad", [6]), ("late", [7])):
        sender.begin(receiver.expect(rid, blocks, deadline=time.monotonic() + 10))
    sends = sender.prepare_sends([ChunkSend("good", (0, 3), (1, 4)), ChunkSend("bad", (2,), (5,)),
                                  ChunkSend("late", (5,), (7,))])
    assert list(sends.failed) == ["bad"] and "not reserved" in sends.failed["bad"] and sends.live_blocks == 3

    def compute_thread() -> None:
        for layer in range(NUM_LAYERS):
            sender.submit_prepared(sends, layer, src_pools[layer])
        sender.submit_prepared(sends, NUM_LAYERS, src_pools[0])  # one layer too many

    await asyncio.to_thread(compute_thread)
    assert made == [(0, 3), (5,)]  # once per chunk, at its first layer
    assert set(sends.failed) == {"bad", "good", "late"} and "layer 3 outside 0..2" in sends.failed["good"]
    await sender.finish("good", 3, None, 20)
    await outcomes.wait("good")
    for src, dst in zip(src_pools, receiver.pools, strict=True):
        assert torch.equal(dst[:, [1, 4, 7]], src[:, [0, 3, 5]])
    await sender.close()


async def test_sender_refuses_what_the_receiver_would(receiver: TcpKVReceiver) -> None:
    sender = TcpKVSender()
    target = receiver.expect("r1", [4], deadline=None)
    with pytest.raises(KVTransferError, match="no transfer begun"):
        await sender.send_layer("r1", 0, make_pools()[0], [4], [4])
    sender.begin(target)
    cases = [
        (NUM_LAYERS, make_pools()[0], [4], "layer 3 outside 0..2"),
        (0, make_pools()[0], [5], r"destination blocks \[5\] not reserved"),
        (0, make_pools(torch.float16)[0], [4], "vs target float32"),
    ]
    for layer, cache, dst, message in cases:
        with pytest.raises(KVTransferError, match=message):
            await sender.send_layer("r1", layer, cache, [4], dst)
    with pytest.raises(KVTransferError, match="already begun"):
        sender.begin(target)
    with pytest.raises(KVTransferError, match="'local' target"):
        sender.begin(TransferTarget("local", "x", (1,), 1, 16, "float32"))


async def test_unreachable_receiver_fails_the_send() -> None:
    sender = TcpKVSender(connect_timeout_s=1)
    target = TransferTarget("tcp", "r1", (0,), NUM_LAYERS, 16, "float32", "127.0.0.1", 1)
    sender.begin(target)
    with pytest.raises(KVTransferError, match="KV send to 127.0.0.1:1 failed"):
        await sender.send_layer("r1", 0, make_pools()[0], [0], [0])
    with pytest.raises(KVTransferError, match="1 layer sends failed"):
        await sender.finish("r1", 1, None, 1)


async def test_no_pickle_in_a_transfer(
    receiver: TcpKVReceiver, outcomes: Outcomes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used during a KV transfer")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    sender = TcpKVSender()
    await push(sender, receiver.expect("r1", [0, 7], deadline=None), make_pools(random=True), [0, 7])
    await outcomes.wait("r1")
    assert "r1" in outcomes.completed
    await sender.close()


def test_no_module_imports_pickle() -> None:
    root = pathlib.Path(pdserve.kv_transfer.__file__).parent
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill)\b", re.MULTILINE)
    for path in root.glob("*.py"):
        assert not pattern.search(path.read_text()), path


def test_threads_are_not_left_behind() -> None:
    assert not [t for t in threading.enumerate() if "asyncio" in t.name and t.is_alive() and t.daemon is False]
