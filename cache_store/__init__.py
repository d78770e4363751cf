"""KV cache storage: the paged block pool, chained prefix hashes and the prefix cache tiers.

    block_pool, prefix_cache, hashing, eviction, policy    torch-free (the router imports `hashing`)
    tiered.TieredKVCache                                   device → host RAM → Redis, for one worker
      host_tier, redis_tier, kv_codec, tier_reader, tier_writer, tier_stats, admission: its parts

This `__init__` imports nothing, so importing `pdserve.cache_store.hashing` (the router does) loads that module
alone (tests/lint/test_import_boundaries.py); import each part from its module
(`from pdserve.cache_store.block_pool import BlockPool`, `from pdserve.cache_store.tiered import TieredKVCache`).
Nothing here knows about models: a block is bytes of a known shape, named by its chained hash.
"""
