"""The paged KV pool's tensors: one per layer, [2, num_blocks, block_size, num_kv_heads, head_dim].

Index 0 holds rotated keys, index 1 values. Token t of a sequence lives in block block_table[t // block_size]
at offset t % block_size, i.e. in flat slot block_table[t // block_size] * block_size + t % block_size. Which
block belongs to which sequence is cache_store's business; the engine only reads and writes the slots given.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import CacheConfig, ModelConfig


def kv_cache_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, int, int, int, int]:
    return (2, cache.num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)


def allocate_kv_caches(
    model: ModelConfig, cache: CacheConfig, device: torch.device | str, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Zeroed, so a padded decode slot that reads an unwritten block sees zeros, never NaN garbage."""
    shape = kv_cache_shape(model, cache)
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(model.num_layers)]


def kv_cache_bytes(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Bytes of all layers' KV tensors."""
    bytes_per_token = model.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size())
    return bytes_per_token * cache.num_blocks * cache.block_size


def blocks_for_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in budget_bytes (all layers, K and V)."""
    per_block = model.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()) * block_size
    return budget_bytes // per_block
