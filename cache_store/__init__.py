"""KV cache storage: the paged block pool, chained prefix hashes and the prefix cache tiers.

Nothing here imports torch or knows about models; `hashing` is imported by the router too.
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
