"""The `store` backend into CUDA pools (shm store): bit-exact, and loading a chunk never waits for the device.

D's receiver loads chunks on I/O threads and scatters them on the event loop, beside the decode loop on the same
(default) stream: a copy to the device from the store's pageable bytes would wait for the step in flight.
Synchronous tests around asyncio.run, so they also run where pytest-asyncio is missing."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.cache_store.shared_store import open_store
from pdserve.kv_transfer.registry import TransferEnv, get_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


async def _transfer(dtype: torch.dtype, busy_cycles: int) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """P's pools on the host, D's on the GPU; `busy_cycles` of work queued on D's stream before the transfer.
    Returns (P's pools, D's pools, whether the device was still busy when D completed the request)."""
    directory = tempfile.mkdtemp(prefix="pdserve-test-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    outcomes = Outcomes()
    backend = get_backend("store")
    d_env = TransferEnv(secret="s", model_fingerprint="fp", store=open_store("shm", directory, None))
    p_env = TransferEnv(secret="s", model_fingerprint="fp", store=open_store("shm", directory, None),
                        chunk_bytes=2 * 2 * 16 * 2 * 8 * torch.finfo(dtype).bits // 8)  # two blocks a value
    receiver = backend.build_receiver(d_env, [p.cuda() for p in make_pools(dtype)], outcomes.on_complete,
                                      outcomes.on_failure)
    sender = backend.build_sender(p_env, None)
    src = make_pools(dtype, random=True)
    try:
        await receiver.start()
        target = receiver.expect("r1", [5, 2, 7], deadline=time.monotonic() + 30, num_tokens=40)
        torch.cuda.synchronize()
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        sender.begin(target)
        for layer in range(NUM_LAYERS):
            await sender.send_layer("r1", layer, src[layer], [0, 3, 1], [5, 2, 7])
        await sender.finish("r1", 11, -1.5, 40)
        await outcomes.wait("r1")
        still_busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert outcomes.completed == {"r1": (11, -1.5)}, outcomes.failed
        return src, receiver.pools, still_busy
    finally:
        await sender.close()
        await receiver.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    src, dst, _ = asyncio.run(_transfer(dtype, 0))
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst[layer][:, [5, 2, 7]].cpu().view(torch.uint8), src[layer][:, [0, 3, 1]].view(torch.uint8))
        assert not dst[layer][:, [0, 1, 3, 4, 6]].view(torch.uint8).any()


def test_loads_are_queued_behind_the_work_in_flight_not_waited_for() -> None:
    """~2 s of work queued on D's stream: the whole transfer lands (every layer scattered, the request complete)
    before the device is done with it. Before, each chunk's copy to the device waited for that work."""
    src, dst, still_busy = asyncio.run(_transfer(torch.bfloat16, 4 << 30))
    assert still_busy, "a chunk's load or scatter waited for the device's queued work"
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst[layer][:, [5, 2, 7]].cpu(), src[layer][:, [0, 3, 1]])
