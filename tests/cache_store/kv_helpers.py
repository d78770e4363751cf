"""Helpers for the cache_store tests: small KV pools with known contents and one worker's cache pieces."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.cache_store.block_pool import BlockPool
from pdserve.cache_store.kv_codec import BlockLayout
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache

LAYERS, BS, HEADS, DIM = 3, 4, 2, 8
FP = "test-model:fp32"
NUM_BLOCKS = 16


def layout(dtype: torch.dtype = torch.float32, fingerprint: str = FP) -> BlockLayout:
    return BlockLayout(fingerprint, LAYERS, BS, HEADS, DIM, dtype)


def random_blocks(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """[n, layers, 2, BS, HEADS, DIM] of distinct values (exact in every dtype's round trip)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((n, LAYERS, 2, BS, HEADS, DIM), generator=generator).to(dtype)


@dataclass
class Worker:
    """One worker's pool, prefix cache and tiered cache (the pieces a node holds)."""

    pool: BlockPool
    prefix_cache: PrefixCache
    kv_caches: list[torch.Tensor]
    cache: TieredKVCache

    def write(self, block_ids: tuple[int, ...] | list[int], seed: int) -> torch.Tensor:
        """'Compute' KV into blocks: random values; returns them as [n, layers, 2, BS, HEADS, DIM]."""
        blocks = random_blocks(len(block_ids), self.kv_caches[0].dtype, seed)
        for layer, kv in enumerate(self.kv_caches):
            kv[:, list(block_ids)] = blocks[:, layer].transpose(0, 1)
        return blocks

    def read(self, block_ids: tuple[int, ...] | list[int]) -> torch.Tensor:
        return torch.stack([kv[:, list(block_ids)] for kv in self.kv_caches]).permute(2, 0, 1, 3, 4, 5)
