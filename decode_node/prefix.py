"""A decode worker's use of its prefix cache: what a reservation takes from it, and what a finished sequence
leaves in it. The cache itself is the worker's one `PrefixCache` / `TieredKVCache` (cache_store/), shared with
its prefill side: the same block hashes, the same eviction policy, the same lookup.

    reserve   lookup = the prompt's full blocks but the one holding its last token (P computes that one for the
              logits; none at all for prompt logprobs: a cached block has no logits)
              allocate(lookup, prompt + 1 blocks) ─▶ [ cached, cached, new, new ]   cached: ref + 1 each
              the transfer target lists only the new blocks: P sends the rest of the prompt, nothing before it
    finish    (stop | length) commit(prompt + output, N - 1 tokens of KV): full blocks named on the device, copied
              to host RAM / Redis when those tiers exist; `pool.free` then leaves them EVICTABLE, so the next
              turn of the conversation finds its whole history here, and evicting them is the pool's policy
    with no prefix cache (`--no-decode-prefix-cache` on a decode-only worker): nothing is looked up, new blocks
              only; finished sequences are still committed (P's next turn may read them from host RAM / Redis)

A colocated worker (`--role both`, `local` transfer) looks up the same way; its node also stages host / Redis
blocks for the reservation (`fetched`), which a disaggregated decode worker does not: it uses its device tier.
"""

from __future__ import annotations

import logging

from pdserve.cache_store.block_pool import BlockPool
from pdserve.cache_store.hashing import prefix_lookup
from pdserve.cache_store.prefix_cache import PrefixCache, SequenceBlocks
from pdserve.cache_store.tier_reader import FetchedPrefix
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.decode_node.request import DecodeRequest

logger = logging.getLogger(__name__)


class DecodePrefix:
    def __init__(self, pool: BlockPool, block_size: int, prefix_cache: PrefixCache | None,
                 tiered: TieredKVCache | None) -> None:
        if tiered is not None and tiered.pool is not pool:
            raise ValueError("the tiered cache must be built over the scheduler's block pool")
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache = prefix_cache  # None: reservations take new blocks only
        self.tiered = tiered  # finished sequences are committed to it; reservations allocate through it

    def lookup_hashes(self, request: DecodeRequest) -> list[bytes]:
        """Full prompt blocks except the one holding the last token; none without a prefix cache, or when the
        request asks for prompt logprobs (P computes its whole prompt: a cached prefix has no logits)."""
        if self.prefix_cache is None or request.sampling.prompt_logprobs is not None:
            return []
        return prefix_lookup(request.block_hashes, len(request.prompt_token_ids), self.block_size)

    def can_reserve(self, lookup: list[bytes], num_blocks: int) -> bool:
        if self.prefix_cache is None:
            return self.pool.can_allocate(num_blocks)
        return self.prefix_cache.can_allocate(lookup, num_blocks)

    def allocate(self, lookup: list[bytes], num_blocks: int, fetched: FetchedPrefix | None) -> SequenceBlocks:
        """The cached prefix of `lookup` (and `fetched`, loaded after it) plus new blocks; all or nothing."""
        if self.prefix_cache is None:
            return SequenceBlocks(self.pool.allocate(num_blocks).block_ids, 0, 0)
        if self.tiered is None:
            return self.prefix_cache.allocate(lookup, num_blocks)
        return self.tiered.allocate(lookup, num_blocks, fetched)

    def commit(self, request: DecodeRequest) -> None:
        """Name the finished sequence's full blocks (prompt + output) and copy them down to host RAM / Redis, so
        the conversation's next turn reuses its whole history, here or on any prefill worker."""
        if self.tiered is None or not request.block_ids:
            return
        try:  # the last sampled token has no KV yet
            self.tiered.commit_sequence(request.all_token_ids, request.num_tokens - 1, request.block_ids,
                                        request.cache_salt)
        except Exception:  # a cache bug must not end the worker's step loop; the blocks are freed anyway
            logger.exception("cannot commit the blocks of %s", request.request_id)
