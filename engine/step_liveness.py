"""Whether a step thread is moving: `StepProgress`, and the one test-only fault that stops it, `StepHang`.

A worker's event loop can stay alive (PINGs answered, heartbeats sent) while its step thread is stuck inside a
forward: a hung kernel, a deadlock, a dead device. Nothing on the data plane shows it, so each step thread
reports how recently it moved, and the router treats a worker whose step thread has not moved for
--stream-stall-timeout as stalled (router/health.py).

    step thread:  progress.tick()  after each layer of a prefill forward (P, and D's local prefills and
                                   recomputes), after each slice of a prompt-logprobs request's logit rows
                                   (256: a 1,400-token prompt's lm_head and log_softmax are ~2 s of CPU),
                                   after each decode step, and on each idle turn of its loop
                                   (at most 0.5 s apart), so an idle or busy thread ticks and a stuck one
                                   does not
    event loop:   progress.stalled_s()  seconds since the last tick; the worker's heartbeat carries the
                                   largest over its step threads (`step_stalled_s`)

A layer is the unit on P because one forward may be long (a 2,048-token forward of the default model takes
~2 s on one CPU thread) while one layer of it is ~1/30 of that. A single layer or decode step that is longer
than the timeout is indistinguishable from a hang: the timeout must exceed the longest one (docs/reliability.md).

`StepHang(after)` is a fault injection for tests only (`--fault-hang-step-after N`, env
PDSERVE_FAULT_HANG_STEP_AFTER): the engine calls `maybe_hang()` inside its forward, holding the model lock,
and the N+1-th call blocks until the engine stops, as a hung forward would, while the event loop runs on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


class StepProgress:
    """Ticks of one step thread; read on any thread (a float, an int and a bool, each written whole).

    A thread waiting for the model lock is not judged: the holder is (a colocated worker's decode steps wait
    for its prefill forwards, which tick per layer; a hung holder shows in its own progress)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.ticks = 0
        self._last: float | None = None  # before the thread's first tick (loading, warm-up): not judged
        self._waiting = False

    @contextlib.contextmanager
    def holding(self, lock: threading.Lock) -> Iterator[None]:
        """`with lock:`, the wait for it not counted as a stall."""
        self._waiting = True
        try:
            lock.acquire()
        finally:
            self._waiting = False
            self.tick()
        try:
            yield
        finally:
            lock.release()

    def tick(self) -> None:
        self.ticks += 1
        self._last = self._clock()

    def stalled_s(self) -> float:
        """Seconds since the thread last moved (0 before its first tick and while it waits for the model lock)."""
        last = self._last
        if self._waiting or last is None:
            return 0.0
        return max(0.0, self._clock() - last)


class StepHang:
    """Test-only: the forward after `after` of them blocks until `stop` is set (the engine's own stop event)."""

    def __init__(self, after: int, stop: threading.Event) -> None:
        if after < 0:
            raise ValueError(f"fault_hang_step_after must be >= 0, got {after}")
        self.after = after
        self._stop = stop
        self.forwards = 0

    def maybe_hang(self) -> None:
        self.forwards += 1
        if self.forwards > self.after:
            self._stop.wait()
