"""Prefill batch formation: a FIFO queue, a token budget per forward, chunked prefill, the prefix cache.

    add() ──▶ QUEUED ──_admit_queued (prefix lookup + blocks)──▶ PREFILLING ──update(): last chunk──▶ FINISHED
                 │                                                   │   ▲ more chunks
                 └──────── abort() / too big ───▶ ABORTED / FAILED ◀─┘   └──────────┘

One `schedule()` packs at most `max_num_batched_tokens` prompt tokens:

    budget 512:  [ A: tokens 512..1023 (continues) ][ B: 0..99 ][ C: 0..304 (first chunk of 2,000) ]

Requests already PREFILLING go first (so a long prompt keeps moving), then queued ones in arrival order; the
first queued one that gets only a partial chunk takes it after the whole prompts queued behind it that fit in
half of what it was left (a short prompt does not wait a forward behind a long one's first chunk); a partial
chunk ends on a block edge when one is in reach (a block split between two forwards would be sent to D twice;
prefill_node/chunking.py, which the planner's simulator calls too). A queued request whose blocks do not fit
waits at the head of the queue (FIFO, no overtaking for blocks: a long prompt is never starved by short ones).
Only the suffix after the cached prefix
is computed; at least one token always is, since its logits give the first token. A request that asks for prompt
logprobs skips the cache and computes its whole prompt (engine/prompt_logprobs.py). With a tiered cache, the
cached prefix is the device's hits followed by the blocks the node fetched from host RAM / Redis before queueing
the request (`request.fetched`), copied into the first new blocks at admission.

A colocated worker hands in requests whose blocks are preassigned: D's reserved blocks (its prefix-cache hits
included), on which P took a reference of its own, so they outlive a D-side abort while P still writes them.

Like the decode scheduler this is not thread-safe; the engine calls it under a lock and an abort of a request
inside a forward only marks it (`update()` finishes it).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cache_store.block_pool import blocks_needed
from pdserve.cache_store.hashing import prefix_lookup
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.prefill_node.chunking import QueuedAdmission, chunk_tokens
from pdserve.prefill_node.request import TRANSITIONS, PrefillRequest, PrefillState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens start..end of one request's prompt, computed in this forward."""

    request: PrefillRequest
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def engine_chunk(self, block_size: int) -> PrefillChunk:
        table = self.request.block_ids[: blocks_needed(self.end, block_size)]
        return PrefillChunk(self.request.prompt_token_ids[self.start:self.end], self.start, table, self.is_last,
                            all_logits=self.request.wants_prompt_logprobs)


@dataclass
class PrefillPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    failed: list[PrefillRequest] = field(default_factory=list)  # refused while scheduling (too big)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Batcher:
    def __init__(self, prefix_cache: PrefixCache, max_num_batched_tokens: int, max_num_seqs: int = 256,
                 tiered: TieredKVCache | None = None) -> None:
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
        if tiered is not None and tiered.prefix_cache is not prefix_cache:
            raise ValueError("the tiered cache must be built over the batcher's prefix cache")
        self.cache = prefix_cache
        self.tiered = tiered  # None: the device prefix cache alone
        self.pool = prefix_cache.pool
        self.block_size = prefix_cache.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, PrefillRequest] = {}
        self.queue: deque[PrefillRequest] = deque()
        self.prefilling: list[PrefillRequest] = []
        self.in_flight: set[str] = set()
        self.abort_requested: set[str] = set()
        self.on_finish: Callable[[PrefillRequest], None] = lambda request: None

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.prefilling)

    def add(self, request: PrefillRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already queued on this prefill worker")
        self.requests[request.request_id] = request
        self.queue.append(request)

    def abort(self, request_id: str, error: str | None = None) -> PrefillRequest | None:
        """Release the request now, or after the forward it is in; returns it if it was finished now."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.error = error
        if request_id in self.in_flight:
            self.abort_requested.add(request_id)
            return None
        self._move(request, PrefillState.ABORTED)
        return request

    def fail(self, request: PrefillRequest, error: str) -> None:
        if request.state.finished:
            return
        request.error = error
        self.in_flight.discard(request.request_id)
        self._move(request, PrefillState.FAILED)

    # ---- one forward ------------------------------------------------------------------------------

    def schedule(self) -> PrefillPlan:
        plan = PrefillPlan()
        budget = self._continue_prefilling(plan, self.max_num_batched_tokens)
        self._admit_queued(plan, budget)
        self.in_flight = {c.request.request_id for c in plan.chunks}
        return plan

    def update(self, plan: PrefillPlan) -> list[PrefillRequest]:
        """The forward of `plan` ran: advance each request; returns those whose whole prompt is computed
        (they stay PREFILLING until `finish`, since their first token and transfer are still to do)."""
        self.in_flight = set()
        done = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.state.finished:  # failed during the forward (its transfer broke)
                continue
            request.num_computed_tokens = chunk.end
            if request.request_id in self.abort_requested:
                self._move(request, PrefillState.ABORTED)
            elif chunk.is_last:
                done.append(request)
        self.abort_requested.clear()
        return done

    def finish(self, request: PrefillRequest) -> None:
        """First token sampled and the KV handed off: commit full prompt blocks, release ours."""
        if self.tiered is not None:  # names the blocks; write-through copies the computed ones down
            self.tiered.commit(request.block_hashes, request.block_ids, request.num_cached_tokens // self.block_size,
                               request.cache_salt)
        else:
            self.cache.commit(request.block_hashes, request.block_ids)
        self._move(request, PrefillState.FINISHED)

    # ---- phases -----------------------------------------------------------------------------------

    def _continue_prefilling(self, plan: PrefillPlan, budget: int) -> int:
        for request in self.prefilling:
            if budget <= 0:
                break
            if request.remaining <= 0:
                continue  # computed; waiting for `finish`
            take = self._take(request, budget)
            plan.chunks.append(ScheduledChunk(request, request.num_computed_tokens, request.num_computed_tokens + take))
            budget -= take
        return budget

    def _admit_queued(self, plan: PrefillPlan, budget: int) -> None:
        """Queued requests in arrival order, each with all its tokens while the budget allows. The first that
        gets only part of its prompt (`partial`) is admitted in its turn (its blocks first: no overtaking for
        blocks) but takes its chunk last: whole prompts queued behind it may use up to half of what was left
        when its turn came, so a short prompt is not kept a whole forward behind a long one's first chunk
        (a 512-token forward takes seconds on a CPU), and the long one still gets at least half."""
        partial: PrefillRequest | None = None
        order = QueuedAdmission(budget)
        for request in list(self.queue):
            if not order.room() or len(self.prefilling) >= self.max_num_seqs:
                break
            if not order.goes_before_partial(request.num_prompt_tokens):
                break  # only whole prompts go before the partial one
            admitted = self._admit(request, plan)
            if admitted is None:
                continue  # refused: it can never fit
            if not admitted:
                break  # its blocks do not fit now: it waits at the head
            if not order.takes_now(request.remaining):
                partial = request
                continue
            take = self._take(request, order.budget)
            plan.chunks.append(ScheduledChunk(request, request.num_computed_tokens, request.num_computed_tokens + take))
            order.spend(take)
        if partial is not None:
            take = self._take(partial, order.budget)
            plan.chunks.append(ScheduledChunk(partial, partial.num_computed_tokens, partial.num_computed_tokens + take))

    def _admit(self, request: PrefillRequest, plan: PrefillPlan) -> bool | None:
        """QUEUED -> PREFILLING with its blocks: True; False when its blocks do not fit now; None when it can
        never fit (FAILED, in `plan.failed`)."""
        needed = blocks_needed(request.num_prompt_tokens, self.block_size)
        if needed > self.pool.num_total:
            request.error = (f"prompt of {request.num_prompt_tokens} tokens needs {needed} KV blocks; this "
                             f"prefill worker has {self.pool.num_total}")
            self._move(request, PrefillState.FAILED)
            plan.failed.append(request)
            return None
        if not request.blocks_preassigned and not self._allocate(request, needed):
            return False
        request.num_computed_tokens = request.num_cached_tokens
        self._move(request, PrefillState.PREFILLING)
        return True

    def _take(self, request: PrefillRequest, budget: int) -> int:
        """Tokens of `request` in this forward: all that remain if the budget allows, else a chunk that ends on a
        block edge when one is in reach (a block split between two forwards is sent to D twice)."""
        return chunk_tokens(request.num_computed_tokens, request.remaining, budget, self.block_size)

    def _allocate(self, request: PrefillRequest, needed: int) -> bool:
        """Cached prefix + new blocks for the prompt, or False when they do not fit now."""
        lookup = prefix_lookup(request.block_hashes, request.num_prompt_tokens, self.block_size)
        if request.wants_prompt_logprobs:
            lookup = []  # a cached prefix has no logits: the whole prompt is computed
        if not self.cache.can_allocate(lookup, needed):
            return False
        if self.tiered is None:
            blocks = self.cache.allocate(lookup, needed)
        else:  # device hits, then the host / Redis blocks fetched for it loaded into the first new blocks
            fetched, request.fetched = request.fetched, None  # staged host memory: freed after this
            try:
                blocks = self.tiered.allocate(lookup, needed, fetched)
            except Exception:  # loading failed (nothing was taken): compute those blocks instead
                logger.exception("loading the fetched blocks of %s failed", request.request_id)
                blocks = self.tiered.allocate(lookup, needed)
        request.block_ids = list(blocks.block_ids)
        request.num_cached_tokens = blocks.num_cached_tokens
        return True

    # ---- the one place a state changes ----------------------------------------------------------

    def _move(self, request: PrefillRequest, state: PrefillState) -> None:
        if state not in TRANSITIONS.get(request.state, frozenset()):
            raise RuntimeError(f"request {request.request_id}: illegal move {request.state.name} -> {state.name}")
        if request.state == PrefillState.QUEUED:
            self.queue.remove(request)
        elif request.state == PrefillState.PREFILLING:
            self.prefilling.remove(request)
        request.state = state
        if state == PrefillState.PREFILLING:
            self.prefilling.append(request)
        elif state.finished:
            self.pool.free(request.block_ids)
            request.block_ids = []
            del self.requests[request.request_id]
            self.on_finish(request)
