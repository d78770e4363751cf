"""The offline `LLM`'s worker: a colocated (`--role both`) worker's pieces, stepped by the caller's thread.

The same objects a `pdserve serve` worker runs, over ONE block pool, so offline and served outputs follow one
policy (issue 21): the decode scheduler (decode_node/scheduler.py: reservations, continuous batching,
preemption by recompute), the prefill batcher (prefill_node/batcher.py: FIFO, token budget, chunks on block
edges), the `local` KV transfer (kv_transfer/local.py: P computes straight into D's reserved blocks) and the
finish checks of engine/output.py. What the served worker does with threads and an event loop, `step` does in
order on the calling thread. A prompt's life:

    submit ──▶ pending ──reserve (D: prompt + 1 blocks, cached prefix from the shared prefix cache; at most
                  │       max_num_seqs prompts live at once, as a router holds back what D cannot run)
                  ▼
    WAITING_FOR_KV on D, QUEUED on P (P holds a reference of its own on D's blocks)
                  │ PrefillEngine.run_step: chunks under the token budget; the last one samples the first token
                  ▼ PrefillEngine.complete ─▶ local sender's "done" ─▶ receiver ─▶ Scheduler.kv_complete
    WAITING ──▶ RUNNING on D: DecodeEngine.run_step, one token a step ──▶ FINISHED_STOPPED / _LENGTH

Each `step` reserves what fits, runs one prefill forward (if P has work) and one decode step (if D has), and
returns the deltas. `close` gives everything back however the caller stopped (all blocks freed).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.decode_node.engine import DecodeEngine
from pdserve.decode_node.request import DecodeRequest
from pdserve.decode_node.scheduler import Scheduler
from pdserve.decode_node.step import RequestOutput
from pdserve.engine.output import OutputProcessor
from pdserve.engine.prompt_logprobs import PromptLogprobs
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler
from pdserve.kv_transfer.local import LocalKVReceiver, LocalKVSender
from pdserve.prefill_node.batcher import Batcher
from pdserve.prefill_node.engine import PrefillEngine
from pdserve.prefill_node.request import PrefillRequest, PrefillState


@dataclass(frozen=True)
class OfflineLimits:
    """The worker's part of the LLM's settings."""

    max_num_seqs: int  # prompts live at once (reserved on D, prefilling or decoding)
    max_num_batched_tokens: int  # prompt tokens one prefill forward packs


@dataclass
class OfflineStats:
    """Counted over an LLM's life, from each call's worker."""

    num_prefill_forwards: int = 0
    num_computed_prompt_tokens: int = 0  # computed, not read from the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_decode_steps: int = 0
    num_generated_tokens: int = 0  # by decode steps (first tokens are sampled by prefill forwards)
    num_preemptions: int = 0

    def add(self, worker: OfflineWorker) -> None:
        prefill, decode = worker.prefill.stats, worker.decode.stats
        self.num_prefill_forwards += prefill.num_forwards
        self.num_computed_prompt_tokens += prefill.num_computed_tokens
        self.num_cached_tokens += prefill.num_cached_tokens
        self.num_decode_steps += decode.num_steps
        self.num_generated_tokens += decode.num_generated_tokens
        self.num_preemptions += worker.scheduler.num_preemptions


class OfflineWorker:
    def __init__(self, runner: ModelRunner, sampler: Sampler, pool: BlockPool, prefix_cache: PrefixCache,
                 decode_prefix_cache: PrefixCache | None, output: OutputProcessor, limits: OfflineLimits) -> None:
        """`prefix_cache` is the batcher's (it commits computed prompt blocks to it); `decode_prefix_cache` the
        one reservations look their prefix up in: the same object, or None for no prefix caching."""
        self.block_size = prefix_cache.block_size
        self.limits = limits
        state_lock, model_lock = threading.RLock(), threading.Lock()  # uncontended: one thread steps
        self.scheduler = Scheduler(pool, self.block_size, output, limits.max_num_seqs, prefix_cache=decode_prefix_cache)
        self.decode = DecodeEngine(self.scheduler, runner, sampler, state_lock, model_lock, async_scheduling=False)
        self.batcher = Batcher(prefix_cache, limits.max_num_batched_tokens, limits.max_num_seqs)
        # wired as a served worker wires them: the receiver's callbacks are the decode engine's
        self.receiver = LocalKVReceiver(runner.kv_caches, self.decode.kv_complete, self.decode.kv_failed)
        self.sender = LocalKVSender(self.receiver)
        self.prefill = PrefillEngine(self.batcher, runner, sampler, self.sender, state_lock, model_lock,
                                     copies_kv=False)
        self.pending: deque[DecodeRequest] = deque()  # submitted, not reserved yet
        self.prefilling: dict[str, PrefillRequest] = {}  # handed to P, prompt not computed yet
        self.prompt_logprobs: dict[str, PromptLogprobs] = {}  # what P collected, for requests that asked
        self._arrived: list[RequestOutput] = []  # first-token deltas of the step's completed transfers
        self.decode.on_outputs = self._arrived.extend

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.scheduler.queues.requests)

    def submit(self, request: DecodeRequest) -> None:
        self.pending.append(request)

    def step(self) -> list[RequestOutput]:
        self._reserve_pending()
        self._arrived.clear()
        preemptions = self.scheduler.num_preemptions
        prefilled = self._prefill_step()
        outputs = [*self._arrived, *self.decode.run_step()]
        if not prefilled and not outputs and self.scheduler.num_preemptions == preemptions:
            queues = self.scheduler.queues
            raise RuntimeError(f"no progress possible: {len(self.pending)} prompts not reserved, "
                               f"{len(queues.requests)} live, {self.scheduler.pool.num_free} of "
                               f"{self.scheduler.pool.num_total} blocks free")
        return outputs

    def close(self) -> None:
        """Abort whatever is still live (the caller stopped early or a step raised): every block goes back."""
        for request in self.prefilling.values():
            self.batcher.fail(request, "the offline generation ended")  # no-op for a finished one
        for request_id in list(self.scheduler.queues.requests):
            self.receiver.cancel(request_id)
            self.scheduler.abort(request_id, "the offline generation ended")
        self.pending.clear()

    # ---- phases -------------------------------------------------------------------------------------

    def _reserve_pending(self) -> None:
        """FIFO: reserve on D while it has room and fewer than max_num_seqs prompts are live."""
        while self.pending and len(self.scheduler.queues.requests) < self.limits.max_num_seqs:
            request = self.pending[0]
            refusal = self.scheduler.reserve(request)
            if refusal is not None:
                if refusal.status == 400:  # can never fit
                    raise ValueError(refusal.message)
                return
            self.pending.popleft()
            self._hand_to_prefill(request)

    def _hand_to_prefill(self, request: DecodeRequest) -> None:
        """P computes the prompt after D's cached prefix straight into D's blocks (`local` transfer)."""
        rid, prompt = request.request_id, request.prompt_token_ids
        target = self.receiver.expect(rid, self.scheduler.expected_block_ids(request), None,
                                      num_tokens=len(prompt) - request.cached_tokens,
                                      first_block=request.cached_tokens // self.block_size)
        block_ids = request.block_ids[: blocks_needed(len(prompt), self.block_size)]
        self.batcher.pool.incref(block_ids)
        prefill = PrefillRequest(rid, prompt, request.sampling, target, request.block_hashes, block_ids=block_ids,
                                 blocks_preassigned=True, num_cached_tokens=request.cached_tokens,
                                 grammar=request.grammar)  # P's draw reads the matcher; D accepts the token
        self.sender.begin(target)
        self.batcher.add(prefill)
        self.prefilling[rid] = prefill

    def _prefill_step(self) -> bool:
        finished = self.prefill.run_step()
        if finished is None:
            return False
        for rid, request in list(self.prefilling.items()):
            if request.state == PrefillState.FAILED:
                raise RuntimeError(f"prefill of {rid} failed: {request.error}")
            if request.state.finished:
                del self.prefilling[rid]
                if request.prompt_logprobs is not None:
                    self.prompt_logprobs[rid] = request.prompt_logprobs
        for request, result in finished:
            _run_now(self.prefill.complete(request, result))
        return True


def _run_now(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run to its end, on this thread, a coroutine that never suspends: the local sender's "done" only records it
    (kv_transfer/local.py). Not through an event loop: the LLM may be called inside a running one (async tests)."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("the local KV hand-off waited for I/O: the offline worker cannot step it synchronously")
