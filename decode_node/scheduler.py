"""Decode scheduler: reservations, continuous batching, preemption by recompute, no leaked block.

    reserve() ──▶ WAITING_FOR_KV ──kv_complete()──▶ WAITING ──_admit_waiting──▶ RUNNING ──update()──▶ FINISHED_*
       │              │ kv_failed() (lease, P gone)   (first token frame sent here)  ▲   │    ▲
       │              ▼                                                              │ _preempt │ _resume_preempted
       │          FINISHED_ERROR / _ABORTED                                          │   ▼    │ (recompute on D)
       │              └──── kv_failed() with kv_load_failure_policy "recompute" ─────│─▶ PREEMPTED
       └─ uncached suffix < max_local_prefill ──▶ LOCAL_PREFILL ──_admit_local_prefills┘
                                                  (no transfer: D prefills the suffix, its decode row samples
                                                   the first token; conditional disaggregation)

KV load failures (the lease ran out, P's connection broke, P gave up) follow `kv_load_failure_policy`, as
vLLM's option of that name: "fail" ends the request with an error frame; "recompute" frees the reserved
blocks and treats the request as preempted with no output yet: D prefills the prompt but its last token, then
its next decode step feeds that last token and samples the first one (greedy and seeded outputs are the same).

Every live request sits in the queue of its state, which changes in one place only: `DecodeQueues.move`
(decode_node/queues.py, with what each move does to the request's blocks); the scheduler decides the moves, by
the rules of decode_node/admission.py (reservation, resume, slots, preemption victim: the planner's simulator
asks the same object).

A step is `schedule()` (phases `_resume_preempted`, `_admit_waiting`, `_grow_running`) then, after the model
ran, `update()`. The engine overlaps them (decode_node/engine.py): step N+1 is scheduled and launched while
step N runs on the device, so a running request may have one token sampled that the host has not read yet
(`num_pending`). Step N+1 then feeds that token straight from the device (`DecodeItem.source_row`: its row in
step N), at position num_tokens - 1 + num_pending, into blocks grown for it. What the host cannot know yet:

    a request that certainly ends at step N (max_tokens, max_model_len) ──▶ not scheduled for N+1
    one that ends at N by EOS / stop string ──▶ its N+1 row is wasted (dropped in update), its blocks freed
                                                only once N+1 completed (no step may still write them)
    a step that would need preemption, or a penalised row (sampling reads the whole output) ──▶ the engine
      first completes step N (`needs_drain`), then schedules as a synchronous loop would

The scheduler never runs the model and is not thread-safe: the decode engine calls it under one lock and
runs the forward outside that lock. So an abort never frees blocks something may still write:
- a request in a launched step is only marked (`abort_requested`); the `update()` of its last launched step
  finishes it;
- a request WAITING_FOR_KV is freed at once, but only after the engine cancelled its expected transfer: the
  receiver then drops any late frame of it before writing (on the event loop, where aborts run too).

Block accounting: a request holding N = prompt + generated tokens needs ceil(N / block_size) blocks before a
step (the K/V of its last generated token is written by that step). `reserve` takes blocks for prompt + 1;
with a prefix cache (the worker's own: decode_node/prefix.py), the cached leading blocks are taken from it, so P
sends only the rest (colocated: blocks fetched from host RAM / Redis are loaded after them). A sequence that
ends with stop or length is committed to the tiered cache (prompt + output, N - 1 tokens of KV) just before its
blocks are freed: they stay EVICTABLE, the next turn's cached prefix.
"""

from __future__ import annotations

import logging

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tier_reader import FetchedPrefix
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.decode_node.admission import DecodeAdmission
from pdserve.decode_node.prefix import DecodePrefix
from pdserve.decode_node.queues import DecodeQueues
from pdserve.decode_node.request import DecodeRequest, RequestState
from pdserve.decode_node.step import DecodeBatch, DecodeItem, RecomputeItem, Refusal, RequestOutput
from pdserve.engine.output import OutputProcessor
from pdserve.engine.sampling import TokenLogprobs

logger = logging.getLogger(__name__)
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
_FINISHED = {"stop": RequestState.FINISHED_STOPPED, "length": RequestState.FINISHED_LENGTH}


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, output: OutputProcessor, max_num_seqs: int,
                 watermark_blocks: int = 1, prefix_cache: PrefixCache | None = None,
                 tiered: TieredKVCache | None = None, kv_load_failure_policy: str = "fail",
                 max_waiting: int | None = None, max_local_prefill_tokens: int | None = None) -> None:
        if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {kv_load_failure_policy!r}")
        self.pool = pool
        self.block_size = block_size
        self.output = output
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = watermark_blocks
        self.admission = DecodeAdmission(block_size, max_num_seqs, watermark_blocks)  # the rules, as arithmetic
        # reservations take their cached prefix from `prefix_cache` (None: new blocks only); finished sequences
        # are committed to `tiered` (the next turn's prefix)
        self.prefix = DecodePrefix(pool, block_size, prefix_cache, tiered)
        self.queues = DecodeQueues(pool, self.prefix)  # every live request, by state (decode_node/queues.py)
        self._rows: dict[str, int] = {}  # request id -> its row in the last scheduled batch
        self.num_preemptions = 0
        self.kv_load_failure_policy = kv_load_failure_policy
        self.max_waiting = max_waiting  # requests held beyond the running batch; more are refused (503)
        # prompt tokens one step prefills for LOCAL_PREFILL requests (the worker's --max-num-batched-tokens: the
        # shapes it warmed up for); None: no limit. A burst of turns waits a step or two instead of one long step
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.num_kv_load_failures = 0  # transfers that failed, whatever the policy did then
        self.num_kv_recomputes = 0  # of those, requests D prefilled itself
        self.num_local_prefills = 0  # reservations D prefilled itself (conditional disaggregation)
        self.num_reused_tokens = 0  # prompt tokens reservations found in this worker's prefix cache (not sent)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.prefix.prefix_cache

    @property
    def tiered(self) -> TieredKVCache | None:
        return self.prefix.tiered

    # ---- requests coming in -------------------------------------------------------------------------

    def reserve(self, request: DecodeRequest, fetched: FetchedPrefix | None = None,
                max_local_prefill: int = 0) -> Refusal | None:
        """Take blocks for prompt + first token; None on success: the request is WAITING_FOR_KV, or
        LOCAL_PREFILL when fewer than `max_local_prefill` of its prompt tokens are not cached here.

        With a prefix cache the cached prefix is taken from it, and `fetched` (host / Redis blocks staged for
        the request by `TieredKVCache.fetch`) is loaded after it."""
        if request.request_id in self.queues.requests:
            return Refusal(f"request {request.request_id!r} is already reserved on this worker", 0.0, 409)
        needed = self.admission.reservation_blocks(len(request.prompt_token_ids))
        if needed > self.pool.num_total - self.watermark_blocks:
            return Refusal(f"prompt of {len(request.prompt_token_ids)} tokens needs {needed} KV blocks; this "
                           f"worker has {self.pool.num_total} in all", 0.0, 400)
        if self.max_waiting is not None and self.queues.num_waiting >= self.max_waiting:
            return Refusal(f"queue full: {self.queues.num_waiting} requests wait on this decode worker already "
                           f"(--max-queued-requests {self.max_waiting})", self._retry_after())
        lookup = self.prefix.lookup_hashes(request)
        if not self.admission.may_reserve(needed, len(self.queues.preempted),
                                          lambda n: self.prefix.can_reserve(lookup, n)):
            return Refusal(f"no room: {needed} KV blocks needed, {self.pool.num_free} of {self.pool.num_total} "
                           f"free, {len(self.queues.preempted)} preempted requests waiting", self._retry_after())
        blocks = self.prefix.allocate(lookup, needed, fetched)
        request.block_ids = list(blocks.block_ids)
        request.cached_tokens = blocks.num_cached_tokens
        self.num_reused_tokens += blocks.num_cached_tokens
        self.queues.add(request)
        uncached = len(request.prompt_token_ids) - request.cached_tokens
        if uncached < max_local_prefill and request.sampling.prompt_logprobs is None:
            self.num_local_prefills += 1
            self.queues.move(request, RequestState.LOCAL_PREFILL)
        return None

    def expected_block_ids(self, request: DecodeRequest) -> list[int]:
        """The blocks P writes: after the cached prefix, up to the prompt's last token (not the +1 block)."""
        end = blocks_needed(len(request.prompt_token_ids), self.block_size)
        return request.block_ids[request.cached_tokens // self.block_size:end]

    def prefix_lookup_hashes(self, request: DecodeRequest) -> list[bytes]:
        return self.prefix.lookup_hashes(request)

    def kv_complete(self, request_id: str, first_token_id: int, cached_tokens: int = 0,
                    logprobs: TokenLogprobs | None = None) -> list[RequestOutput]:
        """P's done frame arrived: emit the first token at once, then wait for a running slot."""
        request = self.queues.requests.get(request_id)
        if request is None or request.state != RequestState.WAITING_FOR_KV:
            return []
        request.num_computed_tokens = len(request.prompt_token_ids)
        request.cached_tokens = max(request.cached_tokens, cached_tokens)
        result = self.output.append_token(request, first_token_id)
        reason = result.finish_reason
        self.queues.move(request, RequestState.WAITING if reason is None else _FINISHED[reason])
        return [RequestOutput.of(request, [first_token_id], result.text, logprobs)]

    def kv_failed(self, request_id: str, error: str) -> list[RequestOutput]:
        """The KV will not come (lease, P gone, P gave up): fail the request, or recompute it here."""
        request = self.queues.requests.get(request_id)
        if request is None or request.state != RequestState.WAITING_FOR_KV:
            return []
        self.num_kv_load_failures += 1
        if self.kv_load_failure_policy == "recompute":
            logger.warning("KV of %s did not arrive (%s): recomputing its %d prompt tokens here", request_id, error,
                           len(request.prompt_token_ids))
            self.num_kv_recomputes += 1
            request.cached_tokens = 0
            self.queues.move(request, RequestState.PREEMPTED)
            return []
        request.error = error
        self.queues.move(request, RequestState.FINISHED_ERROR)
        return [RequestOutput.of(request, [], "")]

    def abort(self, request_id: str, error: str | None = None, hold_blocks: bool = False) -> list[RequestOutput]:
        """Free everything the request holds, now or once nothing writes its blocks any more (see above).
        `hold_blocks`: its KV sender may still write them (cuda_ipc): finish it, but keep them until
        `queues.release_held` (the receiver's word that the sender's part ended)."""
        request = self.queues.requests.get(request_id)
        if request is None:
            return []
        request.error = error
        if hold_blocks:
            self.queues.hold(request)
        if request.num_pending:  # a launched step still writes its blocks: its update() finishes it
            request.abort_requested = True
            return []
        self.queues.move(request, RequestState.FINISHED_ABORTED)
        return [RequestOutput.of(request, [], "")]

    # ---- one step ---------------------------------------------------------------------------------

    def schedule(self) -> DecodeBatch:
        if self._needs_drain():
            return DecodeBatch(needs_drain=True)
        batch = DecodeBatch()
        self._resume_preempted(batch)
        self._admit_waiting()
        self._admit_local_prefills(batch)
        self._grow_running()
        # a request resumed above may have been preempted again by an older one growing
        batch.recompute = [item for item in batch.recompute if item.request.state == RequestState.RUNNING]
        rows: dict[str, int] = {}
        for request in self.queues.running:
            if request.abort_requested or self._ends_in_flight(request):
                continue
            if request.num_pending:  # the step in flight samples its next input on the device
                item = DecodeItem(request, -1, request.num_tokens, request.block_ids, self._rows[request.request_id])
            else:  # the last token: P's first one, or the prompt's own when recomputed
                item = DecodeItem(request, request.all_token_ids[-1], request.num_tokens - 1, request.block_ids)
            rows[request.request_id] = len(batch.decode)
            batch.decode.append(item)
            request.num_pending += 1
        self._rows = rows
        return batch

    def _needs_drain(self) -> bool:
        """Whether scheduling now could need what a step in flight still holds: its sampled tokens (penalties
        read the whole output) or its blocks (preemption)."""
        pending = [r for r in self.queues.running if r.num_pending]
        if not pending:
            return False
        if self.queues.preempted or any(r.needs_history for r in pending):
            return True
        missing = sum(max(0, blocks_needed(r.num_tokens + r.num_pending, self.block_size) - len(r.block_ids))
                      for r in self.queues.running)
        return missing > self.pool.num_free

    def _ends_in_flight(self, request: DecodeRequest) -> bool:
        """The step in flight gives it its last token for sure (max_tokens or the model's length)."""
        pending = request.num_pending
        return bool(pending) and (len(request.output_token_ids) + pending >= request.sampling.max_tokens
                                  or request.num_tokens + pending >= self.output.max_model_len)

    def update(self, batch: DecodeBatch, token_ids: list[int],
               logprobs: list[TokenLogprobs | None] | None = None) -> list[RequestOutput]:
        """The forward of `batch` sampled `token_ids` (one per decode row)."""
        outputs: list[RequestOutput] = []
        for row, item in enumerate(batch.decode):
            request = item.request
            request.num_pending -= 1
            if request.state.finished:  # ended at an earlier step while this one was in flight
                if not request.num_pending:
                    self.queues.release_blocks(request)
                continue
            if request.abort_requested:
                if not request.num_pending:
                    self.queues.move(request, RequestState.FINISHED_ABORTED)
                    outputs.append(RequestOutput.of(request, [], ""))
                continue
            request.num_computed_tokens = request.num_tokens
            result = self.output.append_token(request, token_ids[row])
            if result.finish_reason is not None:
                self.queues.move(request, _FINISHED[result.finish_reason])
            entry = logprobs[row] if logprobs is not None else None
            outputs.append(RequestOutput.of(request, [token_ids[row]], result.text, entry))
        return outputs

    def fail_batch(self, batch: DecodeBatch, error: str) -> list[RequestOutput]:
        """The forward raised: every request in it ends with an error delta (its blocks are freed once no
        launched step holds them)."""
        self._rows = {}
        outputs = []
        for item in batch.decode:
            request = item.request
            request.num_pending -= 1
            if request.state.finished:
                if not request.num_pending:
                    self.queues.release_blocks(request)
                continue
            request.error = error
            self.queues.move(request, RequestState.FINISHED_ERROR)
            outputs.append(RequestOutput.of(request, [], ""))
        return outputs

    # ---- phases -----------------------------------------------------------------------------------

    def _resume_preempted(self, batch: DecodeBatch) -> None:
        """Oldest preempted first; it needs blocks for all its tokens, plus the watermark."""
        while self.queues.preempted and self.admission.has_slot(len(self.queues.running)):
            request = self.queues.preempted[0]
            needed = blocks_needed(request.num_tokens, self.block_size)
            if not self.pool.can_allocate(self.admission.resume_blocks(needed, len(self.queues.running))):
                return
            request.block_ids = list(self.pool.allocate(needed).block_ids)
            request.num_computed_tokens = request.num_tokens - 1
            self.queues.move(request, RequestState.RUNNING)
            if request.num_tokens > 1:  # a one-token prompt whose KV never came has nothing to prefill
                batch.recompute.append(RecomputeItem(request, request.all_token_ids[:-1], request.block_ids))

    def _admit_waiting(self) -> None:
        while self.queues.waiting and self.admission.has_slot(len(self.queues.running)):
            self.queues.move(self.queues.waiting[0], RequestState.RUNNING)

    def _admit_local_prefills(self, batch: DecodeBatch) -> None:
        """Prompt tokens after the cached prefix but the last are prefilled in this step's forward; the last
        one is the request's decode row, which samples the first token (as a recompute's does). At most
        `max_local_prefill_tokens` a step, but always the oldest one."""
        budget = self.max_local_prefill_tokens
        taken = 0
        while self.queues.local_prefills and self.admission.has_slot(len(self.queues.running)):
            request = self.queues.local_prefills[0]
            prompt, start = request.prompt_token_ids, request.cached_tokens
            tokens = max(0, len(prompt) - 1 - start)
            if budget is not None and taken and taken + tokens > budget:
                break
            taken += tokens
            request.num_computed_tokens = len(prompt) - 1
            self.queues.move(request, RequestState.RUNNING)
            if start < len(prompt) - 1:
                batch.recompute.append(RecomputeItem(request, prompt[start:-1], request.block_ids, start, local=True))

    def _grow_running(self) -> None:
        """Give each running request room for its next token, preempting the newest when blocks run out (only
        ever with no step in flight: `_needs_drain`)."""
        index = 0
        while index < len(self.queues.running):
            request = self.queues.running[index]
            missing = blocks_needed(request.num_tokens + request.num_pending, self.block_size) - len(request.block_ids)
            if missing <= 0:
                index += 1
            elif self.pool.can_allocate(missing):
                request.block_ids.extend(self.pool.allocate(missing).block_ids)
                index += 1
            else:
                victim = self.admission.victim(self.queues.running)
                self._preempt(victim)
                if victim is request:
                    return

    def _preempt(self, request: DecodeRequest) -> None:
        if request.num_pending:
            raise RuntimeError(f"request {request.request_id}: preempted while a launched step holds its blocks")
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.queues.move(request, RequestState.PREEMPTED)

    def _retry_after(self) -> float:
        """A guess: about one running request finishes per step; 0.5 s is a few steps on CPU."""
        return 0.5 if self.queues.running else 0.1
