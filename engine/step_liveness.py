"""Whether a step thread is moving: `StepProgress`, and the one test-only fault that stops it, `StepHang`.

A worker's event loop can stay alive (PINGs answered, heartbeats sent) while its step thread is stuck inside a
forward: a hung kernel, a deadlock, a dead device. Nothing on the data plane shows it, so each step thread
reports how recently it moved, and the router treats a worker whose step thread has not moved for
--stream-stall-timeout as stalled (router/health.py).

    step thread:  progress.tick()  after each layer of a prefill forward (P, and D's local prefills and
                                   recomputes), after each decode step, and on each idle turn of its loop
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

import threading
import time
from collections.abc import Callable


class StepProgress:
    """Ticks of one step thread; read on any thread (a float and an int, each written whole)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.ticks = 0
        self._last = clock()

    def tick(self) -> None:
        self.ticks += 1
        self._last = self._clock()

    def stalled_s(self) -> float:
        """Seconds since the thread last moved."""
        return max(0.0, self._clock() - self._last)


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
