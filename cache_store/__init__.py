"""KV cache storage: the paged block pool, chained prefix hashes and the prefix cache tiers.

    block_pool, prefix_cache, hashing, eviction, policy    torch-free (the router imports `hashing`)
    tiered.TieredKVCache                                   device → host RAM → Redis, for one worker
      host_tier, redis_tier, kv_codec, tier_writer, tier_stats, admission: its parts

This package's namespace exports only the torch-free parts, so importing `pdserve.cache_store.hashing` stays
light; import the tiers from their modules (`from pdserve.cache_store.tiered import TieredKVCache`).
Nothing here knows about models: a block is bytes of a known shape, named by its chained hash.
"""

from pdserve.cache_store.block_pool import (
    Allocation,
    BlockPool,
    OutOfBlocksError,
    assert_no_leak,
    blocks_needed,
)
from pdserve.cache_store.hashing import block_hashes, hash_block
from pdserve.cache_store.prefix_cache import PrefixCache, PrefixCacheStats, PrefixMatch, SequenceBlocks

__all__ = [
    "Allocation",
    "BlockPool",
    "OutOfBlocksError",
    "PrefixCache",
    "PrefixCacheStats",
    "PrefixMatch",
    "SequenceBlocks",
    "assert_no_leak",
    "block_hashes",
    "blocks_needed",
    "hash_block",
]
