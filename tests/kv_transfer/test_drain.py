"""Deferred release (issue 16, item 6): a request given up while its sender may still write the receiver's pool
(cuda_ipc) keeps its blocks until the sender's part ended: its "error" or "done", its connection lost, or a
lease of silence. On tcp the receiver writes the pool itself and drops a given-up request's late frames, so it
frees at once: a new request reserved on the same blocks gets exactly its own KV, whatever comes late."""

from __future__ import annotations

import asyncio
import time

import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.kv_transfer.transfer_table import TransferTable


async def test_a_drained_transfer_is_released_by_its_senders_end_only() -> None:
    outcomes, released = Outcomes(), []
    table = TransferTable(NUM_LAYERS, 16, outcomes.on_complete, outcomes.on_failure)
    for rid in ("by-error", "by-done", "by-connection"):
        table.expect(rid, [0], deadline=None, num_tokens=None)
    table.expect("by-lease", [1], deadline=time.monotonic() + 0.2, num_tokens=None)
    for rid in ("by-error", "by-done", "by-lease", "by-connection"):
        assert table.drain(rid, released.append)
    assert not table.drain("unknown", released.append)
    assert released == [] and len(table) == 0 and table.num_draining == 4
    assert table.recently_ended("by-error")  # its frames are expected, and written nowhere
    table.fail("by-error", "sender gave up")  # the sender's "error"
    assert table.complete("by-done", 5, None, 16)  # the sender's "done" (copies landed)
    table.fail("by-connection", "connection lost")
    assert released == ["by-error", "by-done", "by-connection"]
    await asyncio.sleep(0.4)  # the lease of silence
    assert released[-1] == "by-lease" and table.num_draining == 0
    assert not outcomes.completed and not outcomes.failed  # a drained request calls no outcome back


async def test_tcp_frees_at_once_and_late_frames_never_reach_the_next_request(
    receiver: TcpKVReceiver, outcomes: Outcomes
) -> None:
    """The race of issue 16 on tcp: abort mid-transfer, reserve the same blocks for a new request, let the old
    request's remaining layers arrive: the new request's blocks hold its own KV and nothing of the old."""
    sender = TcpKVSender()
    old, new = make_pools(random=True, seed=1), make_pools(random=True, seed=2)
    sender.begin(receiver.expect("old", [2, 3], deadline=None))
    await sender.send_layer("old", 0, old[0], [2, 3], [2, 3])
    assert receiver.release_after_sender("old", lambda rid: None) is False  # D writes itself: free now
    sender.begin(receiver.expect("new", [2, 3], deadline=None))  # the freed blocks, reserved again
    for layer in range(NUM_LAYERS):
        await sender.send_layer("old", layer, old[layer], [2, 3], [2, 3])  # late, and interleaved
        await sender.send_layer("new", layer, new[layer], [2, 3], [2, 3])
    await sender.finish("old", 1, None, 32)
    await sender.finish("new", 2, None, 32)
    await outcomes.wait("new")
    assert outcomes.completed == {"new": (2, None)}
    for layer in range(NUM_LAYERS):
        assert torch.equal(receiver.pools[layer][:, [2, 3]], new[layer][:, [2, 3]])
    await sender.close()
