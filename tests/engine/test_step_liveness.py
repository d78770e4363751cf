"""StepProgress (seconds since a step thread last moved) and the test-only StepHang fault (engine/step_liveness.py)."""

from __future__ import annotations

import threading
import time

from pdserve.engine.step_liveness import StepHang, StepProgress


def test_progress_counts_seconds_since_the_last_tick() -> None:
    now = [10.0]
    progress = StepProgress(clock=lambda: now[0])
    now[0] = 12.5
    assert progress.stalled_s() == 0.0  # not started: a worker loading or warming up is not stalled
    progress.tick()
    now[0] = 15.0
    assert progress.stalled_s() == 2.5
    progress.tick()
    now[0] = 15.25
    assert progress.stalled_s() == 0.25 and progress.ticks == 2


def test_the_hang_blocks_the_forward_after_the_nth_until_the_engine_stops() -> None:
    stop = threading.Event()
    hang = StepHang(2, stop)
    hang.maybe_hang()
    hang.maybe_hang()  # the first two pass
    third = threading.Thread(target=hang.maybe_hang)
    third.start()
    third.join(timeout=0.3)
    assert third.is_alive()  # blocked, as a hung forward
    stop.set()
    third.join(timeout=5)
    assert not third.is_alive()


def test_waiting_for_the_model_lock_is_not_a_stall() -> None:
    now = [0.0]
    progress = StepProgress(clock=lambda: now[0])
    lock = threading.Lock()
    lock.acquire()  # another engine's forward holds it
    waiter = threading.Thread(target=lambda: progress.holding(lock).__enter__())
    waiter.start()
    now[0] = 30.0
    for _ in range(100):
        if progress._waiting:
            break
        time.sleep(0.01)
    assert progress.stalled_s() == 0.0  # judged by the holder, not by the thread in line
    lock.release()
    waiter.join(timeout=5)
    now[0] = 31.0
    assert progress.stalled_s() == 1.0  # it got the lock at 30 s: that counts as moving
