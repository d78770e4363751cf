"""The KV pool's CPU tensors: zeroed, aligned, one buffer a layer, and resident only once touched."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.engine.kv_cache import ALIGN, allocate_kv_caches, kv_cache_shape


def tiny_config() -> ModelConfig:
    return ModelConfig(name="tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_model_len=512)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_cpu_pools_are_zero_aligned_and_one_buffer_a_layer(dtype: torch.dtype) -> None:
    config, cache = tiny_config(), CacheConfig(num_blocks=37, block_size=16)
    pools = allocate_kv_caches(config, cache, "cpu", dtype)
    assert len(pools) == config.num_layers
    for pool in pools:
        assert pool.shape == kv_cache_shape(config, cache) and pool.dtype == dtype and pool.is_contiguous()
        assert pool.data_ptr() % ALIGN == 0 and not pool.float().any()
    pools[0][1, 5].fill_(1.0)  # a write lands in its own layer and block only
    assert pools[0].float().sum() == pools[0][1, 5].numel() and not any(p.float().any() for p in pools[1:])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc/self/statm")
def test_a_cpu_pool_is_resident_only_where_touched() -> None:
    config = tiny_config()
    per_block = 2 * 16 * config.num_kv_heads * config.head_dim * 4 * config.num_layers
    cache = CacheConfig(num_blocks=(512 << 20) // per_block, block_size=16)  # 512 MiB in all
    before = resident_bytes()
    pools = allocate_kv_caches(config, cache, "cpu", torch.float32)
    assert resident_bytes() - before < 32 << 20
    pools[0][:, :8].fill_(2.0)  # the pages written are mapped then; the rest still read as zeros
    assert pools[0][:, :8].eq(2.0).all() and not pools[0][:, 8:].any()
