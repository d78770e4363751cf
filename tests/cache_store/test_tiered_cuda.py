"""The CUDA paths: pinned host tier, device → host copies queued on the stream (events), host → device loads.

Skipped without a GPU (CI); run on an H200 with the rest of tests/cache_store.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.cache_store.policy import CachePolicy, TierConfig
from tests.cache_store.kv_helpers import PROMPT, Worker, drop_device, host_gb, prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pinned_host_tier_round_trip_on_cuda(make_worker: Callable[..., Worker], dtype: torch.dtype) -> None:
    config = TierConfig(host_capacity_gb=host_gb(16), pin_host_memory=True)
    worker = make_worker(config, dtype=dtype, device="cuda")
    assert worker.cache.host._slots.is_pinned()
    cached, stored = prefill(worker, PROMPT)
    assert cached == 0 and worker.cache.flush() and worker.cache.host.num_used == 6
    drop_device(worker)
    for kv in worker.kv_caches:
        kv.zero_()
    cached, loaded = prefill(worker, PROMPT, seed=3)
    assert cached == 24 and torch.equal(loaded.view(torch.uint8), stored.view(torch.uint8))


def test_write_back_copies_evicted_blocks_before_they_are_overwritten(make_worker: Callable[..., Worker]) -> None:
    config = TierConfig(host_capacity_gb=host_gb(16), pin_host_memory=True)
    worker = make_worker(config, CachePolicy(write="write_back"), num_blocks=8, device="cuda")
    _, stored = prefill(worker, PROMPT)
    torch.cuda._sleep(50_000_000)  # keep the stream busy: the copy below is queued, not done, when we return
    filler = worker.pool.allocate(8)  # evicts the 6 cached blocks; their copy to host is queued first
    for kv in worker.kv_caches:
        kv.fill_(-1.0)  # "the next forward" overwrites every block, later on the same stream
    worker.pool.free(filler.block_ids)
    assert worker.cache.flush() and worker.cache.host.num_used == 6
    cached, loaded = prefill(worker, PROMPT, seed=4)
    assert cached == 24 and torch.equal(loaded, stored)
