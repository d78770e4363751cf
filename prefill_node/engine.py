"""The prefill engine: batches from the batcher, forwards on a step thread, KV pushed layer by layer.

    event loop thread                                step thread ("prefill-steps")
    ─────────────────                                ─────────────────────────────
    submit(): sender.begin, batcher.add ──wake──▶    plan = batcher.schedule()
                                                     sends = sender.prepare_sends(chunks)  (checks, ids)
                                                     runner.prefill(chunks, layer_done)   (model_lock)
                                                        └─ layer i done ─▶ sender.submit_prepared(sends, i)
                                                           (blocks copied out now, written on the loop)
                                                     sample first tokens; batcher.update / finish
    complete(): await sender.finish(done frame)  ◀── run_coroutine_threadsafe
                 resolve the node's future (it answers the router with PREFILLED)

Layer i of the whole packed batch goes out while layer i + 1 computes. A chunk carries the blocks its tokens
touch (a block split between two chunks goes twice; the second copy is complete); a request's first chunk also
carries its cached prefix blocks, which the receiver does not have (unless colocated: then it does). Blocks
the receiver found in its own prefix cache are left out of its target, and never sent (`chunk_send`).
A failed send fails that request only; a failed forward fails the requests of that batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from pdserve.cache_store.block_pool import blocks_needed
from pdserve.engine.prompt_logprobs import chunk_entries
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingRequest, TokenLogprobs
from pdserve.engine.step_liveness import StepHang, StepProgress
from pdserve.kv_transfer.base import ChunkSend, KVSender, KVTransferError
from pdserve.prefill_node.batcher import Batcher, PrefillPlan, ScheduledChunk
from pdserve.prefill_node.request import PrefillRequest, PrefillState

logger = logging.getLogger(__name__)


class _EveryoneLeft(Exception):
    """Raised between layers when every request of the forward was aborted: the rest is not computed (a
    1,024-token forward of the default model takes ~2 s on one CPU thread; this frees its slot in one layer)."""


class PrefillError(RuntimeError):
    """A prefill that did not complete; `status` is the HTTP-style status of the PREFILL_FAILED answer."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    logprobs: TokenLogprobs | None  # when the request asked for logprobs
    num_cached_tokens: int
    num_computed_tokens: int
    prefill_s: float


@dataclass
class PrefillStats:
    num_forwards: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0  # of prefills done: looked up in the prefix cache (vLLM's prefix cache queries)
    num_completed: int = 0
    num_failed: int = 0
    forward_seconds: float = 0.0
    transfer_bytes: int = 0  # KV bytes handed to the sender (0 with `local`: nothing is copied)
    transfer_seconds: float = 0.0  # per request, first layer handed over -> "done" written, summed


def chunk_send(chunk: ScheduledChunk, block_size: int) -> ChunkSend:
    """What the chunk pushes after each layer: our blocks into the receiver's, never one the receiver holds.

    The target lists D's blocks from `offset` (the leading blocks D found in its own prefix cache) to the end:

        prompt blocks   0   1   2   3   4   5        offset 3 (D holds 0-2), P's own cache holds 0-1:
        P computes              2   3   4   5        chunk 1 (tokens of blocks 2-3) sends 3; chunk 2 sends 4-5
        target              [   3   4   5 ]          (a first chunk also sends P's cached blocks D lacks)
    """
    request = chunk.request
    assert request.target is not None, "a queued request has its target"
    offset = request.num_uncarried_blocks
    first = chunk.start == request.num_cached_tokens
    lo = offset if first else max(chunk.start // block_size, offset)
    hi = max(blocks_needed(chunk.end, block_size), lo)
    return ChunkSend(request.request_id, tuple(request.block_ids[lo:hi]),
                     tuple(request.target.block_ids[lo - offset:hi - offset]))


class PrefillEngine:
    def __init__(self, batcher: Batcher, runner: ModelRunner, sampler: Sampler, sender: KVSender,
                 state_lock: threading.RLock, model_lock: threading.Lock, copies_kv: bool = True,
                 hang_step_after: int | None = None) -> None:
        self.batcher = batcher
        self.runner = runner
        self.sampler = sampler
        self.sender = sender
        self.state_lock = state_lock
        self.model_lock = model_lock
        self.block_size = batcher.block_size
        self.copies_kv = copies_kv
        cache = runner.kv_caches[0]
        self._block_bytes = cache[:, 0].numel() * cache.element_size()  # one block of one layer, K and V
        self._sending_since: dict[str, float] = {}
        self.stats = PrefillStats()
        self._futures: dict[str, asyncio.Future[PrefillResult]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the step thread's liveness (engine/step_liveness.py); the hang is a test-only fault, None in service
        self.progress = StepProgress()
        self._hang = None if hang_step_after is None else StepHang(hang_step_after, self._stop)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="prefill-steps", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- event loop thread ----------------------------------------------------------------------------

    def submit(self, request: PrefillRequest) -> asyncio.Future[PrefillResult]:
        """Queue a request; raises KVTransferError (nothing queued) when its target cannot be sent to."""
        future: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        assert request.target is not None, "the node attaches the target before submitting"
        self.sender.begin(request.target)
        self._futures[request.request_id] = future
        with self.state_lock:
            self.batcher.add(request)
        self._wake.set()
        return future

    def abort(self, request_id: str, reason: str) -> bool:
        """A request inside the forward now is only marked: its transfer is given up (the receiver told) once
        the forward enqueued its last layer's copies, which `sender.abort` then waits for; so nothing is written
        to D's blocks after D hears of the abort."""
        with self.state_lock:
            known = request_id in self.batcher.requests
            in_forward = request_id in self.batcher.in_flight
            self.batcher.abort(request_id, reason)
        if known:
            self._resolve(request_id, PrefillError(f"aborted: {reason}", 499))
            if not in_forward:
                self._in_background(self.sender.abort(request_id, reason))
        return known

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)

    def _resolve(self, request_id: str, outcome: PrefillResult | Exception) -> None:
        future = self._futures.pop(request_id, None)
        if future is None or future.done():
            return
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    async def complete(self, request: PrefillRequest, result: PrefillResult) -> None:
        """Hand the computed prompt to D (the sender's "done", with the first token) and resolve its future."""
        logprob = None if result.logprobs is None else result.logprobs.logprob
        top = [] if result.logprobs is None else result.logprobs.top  # D's first delta carries them too
        try:
            await self.sender.finish(request.request_id, result.first_token_id, logprob, request.num_carried_tokens,
                                     top)
        except KVTransferError as exc:
            self.stats.num_failed += 1
            self._sending_since.pop(request.request_id, None)
            self._resolve(request.request_id, PrefillError(f"KV hand-off failed: {exc}", 502))
            return
        since = self._sending_since.pop(request.request_id, None)
        if since is not None:
            self.stats.transfer_seconds += time.perf_counter() - since
        self.stats.num_completed += 1
        self._resolve(request.request_id, result)

    async def _fail(self, request: PrefillRequest, message: str, status: int) -> None:
        self.stats.num_failed += 1
        self._sending_since.pop(request.request_id, None)
        self._resolve(request.request_id, PrefillError(message, status))
        await self.sender.abort(request.request_id, message)

    # ---- step thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self.progress.tick()  # a forward done, or an idle turn (at most 0.5 s apart)
            self._wake.clear()
            finished = self.run_step()
            if finished is None:
                self._wake.wait(timeout=0.5)
                continue
            for request, result in finished:
                self._on_loop(self.complete(request, result))

    def run_step(self) -> list[tuple[PrefillRequest, PrefillResult]] | None:
        """Schedule and compute one packed forward on the calling thread; None when nothing was scheduled. Returns
        the requests whose prompt it ended, each with its first token, for `complete` (the hand-off to D): the step
        thread runs that on the event loop, the offline LLM (pdserve/offline_worker.py) at once."""
        with self.state_lock:
            plan = self.batcher.schedule()
        for request in plan.failed:
            self._on_loop(self._fail(request, request.error or "refused", 400))
        if plan.empty:
            return None
        return self._step(plan)

    def _step(self, plan: PrefillPlan) -> list[tuple[PrefillRequest, PrefillResult]]:
        sends = [chunk_send(chunk, self.block_size) for chunk in plan.chunks]
        broken: dict[str, str] = {}
        started = time.perf_counter()
        try:
            first_tokens = self._forward(plan, sends, broken)
        except _EveryoneLeft:  # stopped at a layer boundary: update() below ends them all as ABORTED
            first_tokens = {}
        except Exception as exc:  # a failed forward ends its requests, not the worker
            logger.exception("prefill forward of %d tokens failed", plan.num_tokens)
            self._fail_all([c.request for c in plan.chunks], f"prefill forward failed: {exc!r}", 500)
            return []
        self.stats.num_forwards += 1
        self.stats.num_computed_tokens += plan.num_tokens
        self.stats.forward_seconds += time.perf_counter() - started
        failed = [c.request for c in plan.chunks if c.request.request_id in broken]
        self._fail_all(failed, "; ".join(sorted(set(broken.values()))), 502)
        with self.state_lock:
            done = [r for r in self.batcher.update(plan) if r.request_id not in broken]
            for request in done:
                self.batcher.finish(request)
        for chunk in plan.chunks:  # aborted during this forward: its copies are all enqueued now
            request = chunk.request
            if request.state == PrefillState.ABORTED and request.request_id not in broken:
                self._on_loop(self.sender.abort(request.request_id, request.error or "aborted"))
        return [(request, self._result(request, *first_tokens[request.request_id])) for request in done]

    def _forward(self, plan: PrefillPlan, sends: list[ChunkSend],
                 broken: dict[str, str]) -> dict[str, tuple[int, TokenLogprobs | None]]:
        """One packed forward; returns the first token (and its logprob) of requests whose prompt ended."""
        prepared = self.sender.prepare_sends([s for s in sends if s.src_block_ids])
        broken.update(prepared.failed)

        ids = {c.request.request_id for c in plan.chunks}

        def layer_done(layer: int) -> None:
            self.progress.tick()
            if self.batcher.abort_requested >= ids:  # every request of the batch was aborted meanwhile
                raise _EveryoneLeft
            self.sender.submit_prepared(prepared, layer, self.runner.kv_caches[layer])
            broken.update(prepared.failed)
            if self.copies_kv:
                if layer == 0:
                    for send in prepared.live():
                        self._sending_since.setdefault(send.request_id, time.perf_counter())
                self.stats.transfer_bytes += prepared.live_blocks * self._block_bytes

        chunks = [c.engine_chunk(self.block_size) for c in plan.chunks]
        with self.progress.holding(self.model_lock):  # waiting for it is not a stall
            if self._hang is not None:
                self._hang.maybe_hang()
            output = self.runner.prefill(chunks, layer_done=layer_done, tick=self.progress.tick)
        for i, logits in output.all_logits.items():
            scheduled = plan.chunks[i]
            request = scheduled.request
            assert request.prompt_logprobs is not None and request.sampling.prompt_logprobs is not None
            request.prompt_logprobs += chunk_entries(logits, request.prompt_token_ids, scheduled.start,
                                                     request.sampling.prompt_logprobs, self.progress.tick)
        last = [plan.chunks[i].request for i in output.chunk_indices]
        if not last:
            return {}
        sampled = self.sampler(output.logits, [SamplingRequest(r.sampling, r.prompt_token_ids, [], 0, r.grammar)
                                               for r in last])
        return {r.request_id: (token, lp) for r, token, lp in zip(last, sampled.token_ids, sampled.logprobs, strict=True)}

    def _result(self, request: PrefillRequest, token_id: int, logprobs: TokenLogprobs | None) -> PrefillResult:
        self.stats.num_cached_tokens += request.num_cached_tokens
        self.stats.num_prompt_tokens += request.num_prompt_tokens
        return PrefillResult(request.request_id, token_id, logprobs, request.num_cached_tokens,
                             request.num_prompt_tokens - request.num_cached_tokens, time.monotonic() - request.arrival)

    def _fail_all(self, requests: list[PrefillRequest], message: str, status: int) -> None:
        if not requests:
            return
        with self.state_lock:
            for request in requests:
                self.batcher.fail(request, message)
        for request in requests:
            self._on_loop(self._fail(request, message, status))

    def _on_loop(self, coroutine: Coroutine[Any, Any, None]) -> None:
        if self._loop is None or self._loop.is_closed():
            coroutine.close()
            return
        asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def wake(self) -> None:
        self._wake.set()

