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

from pdserve.decode_node.request import RequestState
from pdserve.decode_node.scheduler import DecodeBatch, RequestOutput, Scheduler
from pdserve.engine.attention_metadata import DecodeInput, PrefillChunk
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, TokenLogprobs

logger = logging.getLogger(__name__)
STEP_PHASES = ("schedule", "forward", "sample", "update", "publish")


@dataclass
class DecodeStats:
    """Counters for /metrics, named for what they count."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_recomputed_tokens: int = 0
    step_seconds: float = 0.0
    # where a step's time goes (wall seconds per phase, summed over steps): the serving overhead a profile of
    # the forward alone does not see. "forward" includes waiting for model_lock (a colocated prefill)
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    forward_cpu_seconds: float = 0.0  # CPU time of the step thread inside forwards (torch's other threads not
    # counted): forward wall time well above it means the thread waited (for a core, the GIL or model_lock)
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests

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


class DecodeEngine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 state_lock: threading.RLock, model_lock: threading.Lock) -> None:
        self.scheduler = scheduler
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
        # the KV receiver's cancel(request_id); the node wires it (no receiver: nothing to cancel)
        self.cancel_transfer: Callable[[str], object] = lambda request_id: None

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

    def kv_complete(self, request_id: str, first_token_id: int, first_logprob: float | None) -> None:
        """Receiver callback: the KV and P's first token are here; the first frame goes out now."""
        logprobs = None if first_logprob is None else TokenLogprobs(first_token_id, first_logprob, [])
        with self.state_lock:
            outputs = self.scheduler.kv_complete(request_id, first_token_id, logprobs=logprobs)
        self.deliver(outputs)
        self._wake.set()

    def kv_failed(self, request_id: str, reason: str) -> None:
        """Receiver callback: the KV will not come; the scheduler fails the request or queues its recompute."""
        with self.state_lock:
            outputs = self.scheduler.kv_failed(request_id, reason)
        self.deliver(outputs)
        self._wake.set()

    def abort(self, request_id: str, reason: str) -> bool:
        """Event loop thread. A request still waiting for its KV is dropped by the receiver first, so no late
        frame can write its blocks once they are free."""
        with self.state_lock:
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.state == RequestState.WAITING_FOR_KV:
                self.cancel_transfer(request_id)
            outputs = self.scheduler.abort(request_id, reason)
        self.deliver(outputs)
        return request is not None

    # ---- the step thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before scheduling: a wake-up that arrives after it is not lost
            self.stats.start_step()
            with self.state_lock:
                batch = self.scheduler.schedule()
            if batch.outputs:
                self._publish(batch.outputs)
            if batch.empty:
                self._wake.wait(timeout=0.5)
                continue
            self.stats.charge("schedule")
            self._publish(self._step(batch))
            self.stats.charge("publish")
            self.stats.end_step()

    def _step(self, batch: DecodeBatch) -> list[RequestOutput]:
        try:
            token_ids, logprobs = self._forward(batch)
        except Exception as exc:  # a failed step must end its requests, not the worker
            logger.exception("decode step of %d requests failed", len(batch.decode))
            with self.state_lock:
                return self.scheduler.fail_batch(batch, f"decode step failed: {exc!r}")
        with self.state_lock:
            outputs = self.scheduler.update(batch, token_ids, logprobs)
        self.stats.charge("update")
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(token_ids)
        return outputs

    def _forward(self, batch: DecodeBatch) -> tuple[list[int], list[TokenLogprobs | None]]:
        chunks = [PrefillChunk(item.token_ids, 0, item.block_ids, need_logits=False) for item in batch.recompute]
        items = [DecodeInput(item.token_id, item.position, item.block_ids) for item in batch.decode]
        requests = [item.request.sampling_request() for item in batch.decode]
        cpu = time.thread_time()
        with self.model_lock:
            if chunks:
                self.runner.prefill(chunks)
                self.stats.num_recomputed_tokens += sum(len(c.token_ids) for c in chunks)
            logits = self.runner.decode(items)
        self.stats.forward_cpu_seconds += time.thread_time() - cpu
        self.stats.charge("forward")
        sampled = self.sampler(logits, requests)
        self.stats.charge("sample")
        return sampled.token_ids, sampled.logprobs

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.deliver, outputs)

    def wake(self) -> None:
        self._wake.set()
