"""fp8 (float8_e4m3fn) KV pools over the byte-moving backends, sender and receiver in this process through the
registry as a worker builds them: tcp, nccl over a real two-rank gloo group, store over shm. Each lands
bit-exact, and a receiver refuses frames that name another dtype."""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import torch
from kv_helpers import NUM_LAYERS, Outcomes, make_pools

from pdserve.cache_store.shared_store import open_store
from pdserve.kv_transfer import get_backend
from pdserve.kv_transfer.registry import TransferEnv

FP8 = torch.float8_e4m3fn
SECRET = "fp8-transfer-test"


def _fp8_pools(random: bool) -> list[torch.Tensor]:
    return [p * 3 for p in make_pools(random=True, seed=3)] if random else make_pools(FP8)


@pytest.mark.parametrize("backend", ["tcp", "nccl", "store"])
async def test_fp8_blocks_arrive_bit_exact(backend: str) -> None:
    short = tempfile.mkdtemp(prefix="fp8s", dir="/tmp")  # the shm store's socket path must stay under 108 bytes
    store = open_store("shm", short, None) if backend == "store" else None
    env = TransferEnv(secret=SECRET, model_fingerprint="fp8-key", store=store)
    outcomes = Outcomes()
    receiver = get_backend(backend).build_receiver(env, make_pools(FP8), outcomes.on_complete, outcomes.on_failure)
    await receiver.start()
    sender = get_backend(backend).build_sender(env, None)
    src = [p.to(FP8) for p in _fp8_pools(random=True)]
    target = receiver.expect("r", [5, 2], deadline=time.monotonic() + 30, num_tokens=32)
    assert target.dtype == "float8_e4m3fn"
    sender.begin(target)
    for layer in range(NUM_LAYERS):
        await sender.send_layer("r", layer, src[layer], [1, 4], [5, 2])
    await sender.finish("r", 7, None, 32)
    await outcomes.wait("r", timeout_s=30)
    assert "r" in outcomes.completed, outcomes.failed
    for layer in range(NUM_LAYERS):
        got = receiver.pools[layer][:, [5, 2]].view(torch.uint8)
        assert torch.equal(got, src[layer][:, [1, 4]].view(torch.uint8))
        assert receiver.pools[layer].dtype == FP8
    await sender.close()
    await receiver.close()
    shutil.rmtree(short, ignore_errors=True)


def test_a_frame_of_another_dtype_is_refused() -> None:
    outcomes = Outcomes()
    receiver = get_backend("tcp").build_receiver(TransferEnv(), make_pools(FP8), outcomes.on_complete,
                                                 outcomes.on_failure)
    shape = receiver.layout.block_shape(1)
    problem = receiver.check_blocks("x", 0, [1], "bfloat16", shape, 2 * 2 * 16 * 2 * 8)
    assert problem is not None and "float8_e4m3fn" in problem
    nbytes = shape[0] * shape[2] * shape[3] * shape[4]  # one byte a value
    assert receiver.check_blocks("x", 0, [1], "float8_e4m3fn", shape, nbytes) is None
