"""Continuous batching for the offline `LLM`: one process holds the model, the block pool and every sequence.

A sequence's life:

    add() ──▶ WAITING ──_admit: blocks for all tokens, cached prefix reused──▶ PREFILLING
                 ▲                                                                │ chunks under the
                 │ _preempt: blocks freed, prompt + output recomputed later       │ token budget
                 │                                                                ▼
                 └─────────────────────────────────────────────────────────── DECODING ──finish()──▶ FINISHED

A step (`schedule`): every DECODING sequence gets one token (growing by a block when it crosses a block
boundary; when the pool is empty the newest DECODING sequence is preempted), then PREFILLING sequences and
newly admitted ones share what is left of `max_num_batched_tokens`, at most `chunk_size` tokens each.
`advance` then records what the model computed and commits the prompt's full blocks to the prefix cache,
so prompts admitted in later steps reuse them.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.engine.sampling_params import SamplingParams


class SeqState(enum.IntEnum):
    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3


@dataclass
class OfflineSequence:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_hashes: list[bytes] = field(default_factory=list)  # full prompt blocks (prefix caching)
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in block_ids
    num_cached_tokens: int = 0  # of those, found in the prefix cache at the last admission
    num_committed_blocks: int = 0
    num_preemptions: int = 0
    state: SeqState = SeqState.WAITING

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SchedulerStats:
    """Counted since the scheduler was made (an LLM keeps one for its lifetime)."""

    num_steps: int = 0
    num_prefill_tokens: int = 0  # computed, not read from the prefix cache
    num_decode_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, end) of seq's tokens to prefill; the model samples after it when end == num_tokens."""

    seq: OfflineSequence
    start: int
    end: int

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class StepPlan:
    decodes: list[OfflineSequence]
    prefills: list[ScheduledChunk]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class OfflineScheduler:
    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache | None, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, chunk_size: int, stats: SchedulerStats | None = None) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size
        self.stats = stats or SchedulerStats()
        self.waiting: deque[OfflineSequence] = deque()
        self.running: list[OfflineSequence] = []  # PREFILLING and DECODING, oldest admission first

    def add(self, seq: OfflineSequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        decodes = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(decodes)
        prefills: list[ScheduledChunk] = []
        for seq in [s for s in self.running if s.state is SeqState.PREFILLING]:
            if budget <= 0:
                break
            budget -= self._add_chunk(seq, budget, prefills)
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            budget -= self._add_chunk(self.waiting.popleft(), budget, prefills)
        return StepPlan(decodes, prefills)

    def advance(self, plan: StepPlan) -> None:
        """The model computed the plan: K/V of those tokens are cached."""
        self.stats.num_steps += 1
        self.stats.num_decode_tokens += len(plan.decodes)
        for seq in plan.decodes:
            seq.num_computed += 1
        for chunk in plan.prefills:
            chunk.seq.num_computed = chunk.end
            self.stats.num_prefill_tokens += chunk.end - chunk.start
            if chunk.samples:
                chunk.seq.state = SeqState.DECODING
            self._commit(chunk.seq)

    def finish(self, seq: OfflineSequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.state = SeqState.FINISHED
        self.running.remove(seq)

    def _schedule_decodes(self) -> list[OfflineSequence]:
        """Each DECODING sequence needs room for the K/V of its last token (at position num_computed)."""
        candidates = [s for s in self.running if s.state is SeqState.DECODING]
        decodes: list[OfflineSequence] = []
        while candidates:
            seq = candidates[0]
            needed = blocks_needed(seq.num_computed + 1, self.block_size) - len(seq.block_ids)
            if self.pool.can_allocate(needed):
                seq.block_ids.extend(self.pool.allocate(needed).block_ids)
                decodes.append(candidates.pop(0))
            else:
                self._preempt(candidates.pop())  # the newest; may be seq itself
        return decodes

    def _admit(self, seq: OfflineSequence) -> bool:
        """Blocks for all of seq's tokens, reusing the longest cached prefix (never its last token: that one
        must be computed to produce logits). False when the pool has no room yet."""
        needed = blocks_needed(seq.num_tokens, self.block_size)
        if self.prefix_cache is None:
            if not self.pool.can_allocate(needed):
                return False
            seq.block_ids = list(self.pool.allocate(needed).block_ids)
            seq.num_computed = seq.num_cached_tokens = 0
        else:
            lookup = seq.prompt_hashes[: (seq.num_tokens - 1) // self.block_size]
            if seq.params.prompt_logprobs is not None:
                lookup = []  # a cached prefix has no logits (engine/prompt_logprobs.py)
            if not self.prefix_cache.can_allocate(lookup, needed):
                return False
            blocks = self.prefix_cache.allocate(lookup, needed)
            seq.block_ids = list(blocks.block_ids)
            seq.num_computed = seq.num_cached_tokens = blocks.num_cached_tokens
            seq.num_committed_blocks = blocks.num_cached_blocks
            self.stats.num_cached_tokens += blocks.num_cached_tokens
        seq.state = SeqState.PREFILLING
        self.running.append(seq)
        return True

    def _add_chunk(self, seq: OfflineSequence, budget: int, prefills: list[ScheduledChunk]) -> int:
        take = min(seq.num_tokens - seq.num_computed, self.chunk_size, budget)
        prefills.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + take))
        return take

    def _preempt(self, seq: OfflineSequence) -> None:
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = seq.num_committed_blocks = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        seq.state = SeqState.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _commit(self, seq: OfflineSequence) -> None:
        if self.prefix_cache is None:
            return
        full = min(len(seq.prompt_hashes), seq.num_computed // self.block_size)
        if full > seq.num_committed_blocks:
            start = seq.num_committed_blocks
            self.prefix_cache.commit(seq.prompt_hashes[start:full], seq.block_ids[start:full])
            seq.num_committed_blocks = full
