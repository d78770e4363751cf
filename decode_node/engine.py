"""The decode engine: the scheduler, the step thread, and the hand-off of every step's deltas to the data plane.

Threads (the event loop must never wait for the model; the step thread never touches asyncio objects):

    event loop thread                                    step thread ("decode-steps")
    ─────────────────                                    ────────────────────────────
    reserve / abort              ──state_lock──▶ Scheduler ◀──state_lock──  schedule() ... update()
    receiver callbacks (KV done)                                              │
    on_outputs (one TOKENS per  ◀── loop.call_soon_threadsafe(deliver) ◀──────┘  forward under model_lock
    router connection per step)

`state_lock` guards the scheduler and the block pool (shared with the prefill side in a colocated worker);
it is never held during a forward. `model_lock` serialises forwards of the runner (both roles use one runner
when colocated). Deltas produced on the loop thread (first token, aborts) are delivered directly.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.decode_node.request import RequestState
from pdserve.decode_node.scheduler import Scheduler
from pdserve.decode_node.step import DecodeBatch, RequestOutput
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import PendingSample, Sampler, TokenLogprobs
from pdserve.engine.step_liveness import StepHang, StepProgress

logger = logging.getLogger(__name__)
# schedule: the next step planned; launch: its inputs staged and its forward and draw queued (on CPU the
# forward runs here); wait: for the step in flight's ids; update: finish checks and text; publish: hand-off
STEP_PHASES = ("schedule", "launch", "wait", "update", "publish")
DEVICE_PARTS = ("forward", "sample")


@dataclass
class DecodeStats:
    """Counters for /metrics, named for what they count."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_local_prefill_tokens: int = 0  # prompt tokens D prefilled itself (conditional disaggregation)
    step_seconds: float = 0.0
    num_batched_rows: int = 0  # decode rows over all steps: / num_steps is the mean decode batch
    # where a step's time goes (wall seconds per phase, summed over steps): the serving overhead a profile of
    # the forward alone does not see. "launch" includes waiting for model_lock (a colocated prefill)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    forward_cpu_seconds: float = 0.0  # CPU time of the step thread inside forwards (torch's other threads not
    # counted): forward wall time well above it means the thread waited (for a core, the GIL or model_lock)
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests
    # on CUDA, the device's own time (CUDA events) per part of a step, summed: "forward" from staging the inputs
    # to the graph's end, "sample" the draw; beside the wall phases, it tells a slow device from a slow host
    device_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DEVICE_PARTS, 0.0))
    num_forward_rows: int = 0  # rows the forwards ran, padding to the CUDA-graph bucket included

    _step_start: float = field(default=0.0, repr=False)
    _mark: float = field(default=0.0, repr=False)

    def start_step(self) -> None:
        self._step_start = self._mark = time.perf_counter()

    def charge(self, phase: str) -> None:
        """The time since the last phase ended (or the step started) goes to `phase`."""
        now = time.perf_counter()
        self.phase_seconds[phase] += now - self._mark
        self._mark = now

    def end_step(self) -> None:
        self.step_seconds += self._mark - self._step_start


@dataclass(frozen=True)
class _Launched:
    """A step whose forward and draw are queued on the device; its ids are read by `_complete`. `sample` None:
    the draw waits for the step before it (a grammar row's mask needs that step's token accepted)."""

    batch: DecodeBatch
    sample: PendingSample | None
    logits: torch.Tensor | None = None
    marks: list[torch.cuda.Event] | None = None  # CUDA: forward start, forward end, draw end (see DecodeStats)


class DecodeEngine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 state_lock: threading.RLock, model_lock: threading.Lock, async_scheduling: bool = True,
                 hang_step_after: int | None = None) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.runner = runner
        self.sampler = sampler
        self.state_lock = state_lock
        self.model_lock = model_lock
        self.stats = DecodeStats()
        # the data plane's sink for every step's deltas (decode_node/service.py wires it); loop thread only
        self.on_outputs: Callable[[list[RequestOutput]], None] = lambda outputs: None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the step thread's liveness (engine/step_liveness.py); the hang is a test-only fault, None in service
        self.progress = StepProgress()
        self._hang = None if hang_step_after is None else StepHang(hang_step_after, self._stop)
        # the KV receiver's cancel(request_id) and release_after_sender(request_id, on_released) -> held; the
        # node wires them (no receiver: nothing to cancel, nothing to wait for)
        self.cancel_transfer: Callable[[str], object] = lambda request_id: None
        self.release_transfer: Callable[[str, Callable[[str], None]], bool] = lambda request_id, released: False

    # ---- life -----------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="decode-steps", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- called on the event loop -------------------------------------------------------------------

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand deltas to the data plane (event loop thread)."""
        for output in outputs:
            reason = output.delta.finish_reason
            if reason is not None:
                self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if outputs:
            self.on_outputs(outputs)

    def kv_complete(self, request_id: str, first_token_id: int, first_logprob: float | None,
                    first_top: list[tuple[int, float]] | None = None) -> None:
        """Receiver callback: the KV and P's first token (its logprob and top-k) are here; the first frame goes
        out now, with the same logprobs as P's PREFILLED."""
        if self._after_grammar(request_id, self.kv_complete, request_id, first_token_id, first_logprob, first_top):
            return
        top = [(int(t), float(lp)) for t, lp in first_top or []]
        logprobs = None if first_logprob is None else TokenLogprobs(first_token_id, first_logprob, top)
        with self.state_lock:
            outputs = self.scheduler.kv_complete(request_id, first_token_id, logprobs=logprobs)
        self.deliver(outputs)
        self._wake.set()

    def kv_failed(self, request_id: str, reason: str) -> None:
        """Receiver callback: the KV will not come; the scheduler fails the request or queues its recompute."""
        if self._after_grammar(request_id, self.kv_failed, request_id, reason):
            return
        with self.state_lock:
            outputs = self.scheduler.kv_failed(request_id, reason)
        self.deliver(outputs)
        self._wake.set()

    def _after_grammar(self, request_id: str, callback: Callable[..., None], *args: object) -> bool:
        """Whether the request's matcher is still being built (the worker's first constrained requests wait for
        xgrammar to load: decode_node/node.py). Then its first token, or its recompute, must wait for the
        matcher: `callback(*args)` runs again on the event loop, queued behind the node's attaching it."""
        with self.state_lock:
            request = self.scheduler.queues.requests.get(request_id)
            loading = None if request is None else request.grammar_loading
        loop = self._loop
        if loading is None or loop is None:
            return False
        loading.add_done_callback(lambda _: loop.call_soon_threadsafe(callback, *args))
        return True

    def abort(self, request_id: str, reason: str, sender_may_write: bool = True) -> bool:
        """Event loop thread. A request still waiting for its KV is dropped by the receiver first, so no late
        frame can write its blocks once they are free; where the sender writes the pool itself (cuda_ipc) and
        may have begun, its blocks are held until the receiver says its part ended."""
        with self.state_lock:
            request = self.scheduler.queues.requests.get(request_id)
            held = False
            if request is not None and request.state == RequestState.WAITING_FOR_KV:
                if sender_may_write:
                    held = self.release_transfer(request_id, self._release_held)
                else:
                    self.cancel_transfer(request_id)
            outputs = self.scheduler.abort(request_id, reason, hold_blocks=held)
        self.deliver(outputs)
        return request is not None

    def _release_held(self, request_id: str) -> None:
        """Receiver callback (event loop thread): the sender of an aborted request cannot write any more."""
        with self.state_lock:
            self.scheduler.queues.release_held(request_id)

    # ---- the step thread ----------------------------------------------------------------------------
    #
    # One iteration, with step N on the device (`in_flight`):
    #   schedule N+1 (its carried rows read N's tokens on the device) ─▶ launch N+1 (inputs staged in pinned
    #   memory, graph replay, sampling; nothing waits) ─▶ wait for N's ids ─▶ update N ─▶ publish N's deltas
    # so the host's work for N+1 and for N's outputs runs while N+1 computes. `async_scheduling` False (or a
    # batch that `needs_drain`) completes N before scheduling: the synchronous loop, with the same outputs.
    # A batch with a grammar row (structured outputs) launches N+1's forward only; its draw follows update N,
    # which accepted N's tokens into the matchers: the masks of N+1 are filled while N+1's forward runs.

    def _run(self) -> None:
        in_flight: _Launched | None = None
        while not self._stop.is_set():
            self.progress.tick()  # a step done, or an idle turn (at most 0.5 s apart)
            self._wake.clear()  # before scheduling: a wake-up that arrives after it is not lost
            self.stats.start_step()
            batch = self._schedule()
            if batch.needs_drain:
                self._finish(in_flight)
                in_flight = None
                batch = self._schedule()
            launched = None
            if not batch.empty:
                launched = self._launch(batch, in_flight)
                if launched is None:  # the launch failed: its requests end, once the step before completed
                    self._finish(in_flight)
                    in_flight = None
                    with self.state_lock:
                        self._publish(self.scheduler.fail_batch(batch, "decode step failed (see the log)"))
            self._finish(in_flight)
            if launched is not None and launched.sample is None:
                launched = self._draw(launched)  # N's tokens are in the matchers now: N+1's masks, its draw
            if self.async_scheduling:
                in_flight = launched
            else:
                self._finish(launched)
                in_flight = None
            self.stats.end_step()
            if in_flight is None and batch.empty:
                self._wake.wait(timeout=0.5)
        self._finish(in_flight)

    def run_step(self) -> list[RequestOutput]:
        """One step on the calling thread with nothing in flight before or after it (the offline LLM's loop,
        pdserve/offline_worker.py): schedule, forward, draw, update; its deltas ([] when nothing ran). A forward
        that raises ends the batch's requests with an error and propagates."""
        self.stats.start_step()
        with self.state_lock:
            batch = self.scheduler.schedule()
        if batch.empty:
            return list(batch.outputs)
        try:
            launched = self._forward(batch, None)
        except Exception:
            with self.state_lock:
                self.scheduler.fail_batch(batch, "decode step failed")
            raise
        outputs = list(batch.outputs) + self._complete(launched)
        self.stats.end_step()
        return outputs

    def _finish(self, launched: _Launched | None) -> None:
        """Complete a launched step (if any) and publish its deltas."""
        if launched is not None:
            self._publish(self._complete(launched))

    def _schedule(self) -> DecodeBatch:
        with self.state_lock:
            batch = self.scheduler.schedule()
        self.stats.charge("schedule")
        if batch.outputs:
            self._publish(batch.outputs)
        return batch

    def _launch(self, batch: DecodeBatch, in_flight: _Launched | None) -> _Launched | None:
        """Queue the step's forward and draw; None when that raised."""
        try:
            launched = self._forward(batch, in_flight)
        except Exception:  # a failed step must end its requests, not the worker
            logger.exception("decode step of %d requests failed", len(batch.decode))
            launched = None
        self.stats.charge("launch")
        return launched

    def _forward(self, batch: DecodeBatch, in_flight: _Launched | None) -> _Launched:
        """The step's forward, and its draw unless a grammar row must wait for the step in flight's token
        (structured outputs: the mask is filled on the host while this forward runs on the device)."""
        chunks = [PrefillChunk(item.token_ids, item.start, item.block_ids, need_logits=False)
                  for item in batch.recompute]
        items = [DecodeInput(item.token_id, item.position, item.block_ids, item.source_row) for item in batch.decode]
        requests = [item.request.sampling_request() for item in batch.decode]
        carried = None
        if in_flight is not None:
            assert in_flight.sample is not None, "_run keeps a step in flight only once it has drawn"
            carried = in_flight.sample.tokens
        cpu = time.thread_time()
        with self.progress.holding(self.model_lock):  # waiting for it is not a stall
            if self._hang is not None:
                self._hang.maybe_hang()
            if chunks:  # local prefills and recomputes: a tick per layer, as P's forwards
                self.runner.prefill(chunks, layer_done=lambda layer: self.progress.tick())
                for item in batch.recompute:
                    if item.local:
                        self.stats.num_local_prefill_tokens += len(item.token_ids)
                    else:
                        self.stats.num_recomputed_tokens += len(item.token_ids)
            marks = self._mark(None)
            logits = self.runner.decode(items, carried)
            self._mark(marks)
            self.stats.num_forward_rows += self.runner.last_decode_rows
        if in_flight is not None and any(r.grammar is not None for r in requests):
            self.stats.forward_cpu_seconds += time.thread_time() - cpu
            return _Launched(batch, None, logits, marks)
        sample = self.sampler.sample(logits, requests)
        self._mark(marks)
        self.stats.forward_cpu_seconds += time.thread_time() - cpu
        return _Launched(batch, sample, marks=marks)

    def _mark(self, marks: list[torch.cuda.Event] | None) -> list[torch.cuda.Event] | None:
        """Record the next of a step's CUDA events on the current stream (a new list from None); None on CPU."""
        if self.runner.device.type != "cuda":
            return None
        marks = [] if marks is None else marks
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(event)
        return marks

    def _draw(self, launched: _Launched) -> _Launched | None:
        """The deferred draw of a launched step (grammar masks from the matchers' current state); None when it
        raised (its requests end with an error)."""
        assert launched.logits is not None
        # built now, not at launch: a seeded draw counts the tokens the host has read since (the step before's)
        requests = [item.request.sampling_request() for item in launched.batch.decode]
        try:
            sample = self.sampler.sample(launched.logits, requests)
            self._mark(launched.marks)
        except Exception:
            logger.exception("sampling a decode step of %d requests failed", len(launched.batch.decode))
            with self.state_lock:
                self._publish(self.scheduler.fail_batch(launched.batch, "decode step failed (see the log)"))
            return None
        self.stats.charge("launch")
        return _Launched(launched.batch, sample, marks=launched.marks)

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for the step's ids, then update the requests."""
        assert launched.sample is not None, "a deferred draw is made before the step completes"
        try:
            sampled = launched.sample.result()
        except Exception as exc:  # a device error surfaces at the first wait
            logger.exception("decode step of %d requests failed", len(launched.batch.decode))
            with self.state_lock:
                return self.scheduler.fail_batch(launched.batch, f"decode step failed: {exc!r}")
        self.stats.charge("wait")
        if launched.marks is not None and len(launched.marks) == 3:
            launched.marks[2].synchronize()  # recorded just after the ids' copy, which result() waited for
            for part, (start, end) in zip(DEVICE_PARTS, zip(launched.marks, launched.marks[1:])):
                self.stats.device_seconds[part] += start.elapsed_time(end) / 1000
        with self.state_lock:
            outputs = self.scheduler.update(launched.batch, sampled.token_ids, sampled.logprobs)
        self.stats.charge("update")
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(sampled.token_ids)
        self.stats.num_batched_rows += len(launched.batch.decode)
        return outputs

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.deliver, outputs)
        self.stats.charge("publish")

    def wake(self) -> None:
        self._wake.set()
