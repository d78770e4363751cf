"""CUDA pools on both sides: the pinned staging + event path of the sender and the device scatter of the
receiver. Synchronous tests around asyncio.run, so they also run where pytest-asyncio is missing."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


async def _round_trip(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], Outcomes]:
    outcomes = Outcomes()
    dst_pools = [p.cuda() for p in make_pools(dtype)]
    src_pools = [p.cuda() for p in make_pools(dtype, random=True)]
    receiver = TcpKVReceiver("127.0.0.1", 0, dst_pools, outcomes.on_complete, outcomes.on_failure)
    await receiver.start()
    sender = TcpKVSender()
    sender.begin(receiver.expect("r1", [7, 0, 3], deadline=None))
    stream = torch.cuda.Stream()

    def compute_thread() -> None:
        # Each layer is "computed" on a side stream just before it is submitted: the gather must see it.
        with torch.cuda.stream(stream):
            for layer in range(NUM_LAYERS):
                src_pools[layer][:, [1, 2, 5]] *= 2
                sender.submit_layer("r1", layer, src_pools[layer], [1, 2, 5], [7, 0, 3])

    thread = threading.Thread(target=compute_thread)
    thread.start()
    await asyncio.to_thread(thread.join)
    await sender.finish("r1", 5, -0.1, 40)
    await outcomes.wait("r1")
    await sender.close()
    await receiver.close()
    return src_pools, dst_pools, outcomes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    src_pools, dst_pools, outcomes = asyncio.run(_round_trip(dtype))
    assert outcomes.completed == {"r1": (5, -0.1)}
    for src, dst in zip(src_pools, dst_pools):
        assert torch.equal(dst[:, [7, 0, 3]].view(torch.uint8), src[:, [1, 2, 5]].view(torch.uint8))
        assert not dst[:, [1, 2, 4, 5, 6]].any()


def test_a_received_layer_is_queued_behind_the_work_in_flight_not_waited_for() -> None:
    """D's receiver runs beside the decode loop on the same stream: scattering a layer must not make its
    thread wait for what the device has queued (a pageable copy does: the decode step in flight, per layer)."""
    pools = [p.cuda() for p in make_pools(torch.bfloat16)]
    receiver = TcpKVReceiver("127.0.0.1", 0, pools, Outcomes().on_complete, Outcomes().on_failure)
    receiver.expect("r1", [7, 0, 3], deadline=None)
    blocks = torch.randn(2, 3, *pools[0].shape[2:]).to(torch.bfloat16).pin_memory()
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s of queued work on the current stream
    receiver.write_blocks("r1", 0, [7, 0, 3], blocks)
    assert not torch.cuda.current_stream().query(), "write_blocks waited for the device's queued work"
    torch.cuda.synchronize()
    assert torch.equal(pools[0][:, [7, 0, 3]].cpu(), blocks)
