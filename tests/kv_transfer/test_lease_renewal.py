"""The reservation lease counts silence, not the whole transfer: every KV frame renews it."""

from __future__ import annotations

import asyncio
import time

from kv_helpers import Outcomes, make_pools

from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender


async def test_frames_renew_the_lease(receiver: TcpKVReceiver, outcomes: Outcomes) -> None:
    """A transfer that lasts 4 leases but never pauses for one completes; it fails once the sender stalls."""
    sender = TcpKVSender()
    pools = make_pools(random=True)
    lease_s = 0.25
    target = receiver.expect("steady", [0, 1], deadline=time.monotonic() + lease_s)
    stalled = receiver.expect("stalled", [2], deadline=time.monotonic() + lease_s)
    sender.begin(target)
    sender.begin(stalled)
    started = time.monotonic()
    for step in range(8):  # a layer may be sent again (a block split between two chunks is)
        layer = step % len(pools)
        await sender.send_layer("steady", layer, pools[layer], [0, 1], [0, 1])
        if step == 0:
            await sender.send_layer("stalled", 0, pools[0], [2], [2])
        await asyncio.sleep(lease_s / 2)
    await sender.finish("steady", 7, None, 32)
    await outcomes.wait("steady", timeout_s=3)
    await outcomes.wait("stalled", timeout_s=3)
    assert time.monotonic() - started > 3 * lease_s
    assert "steady" in outcomes.completed, outcomes.failed
    assert outcomes.failed["stalled"].startswith("lease of 0.250 s expired (layer 1 lacks blocks [2]), no KV for 0.2")
    await sender.close()
