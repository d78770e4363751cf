"""How `pdserve serve` restarts a child that exits: exponential backoff, a bounded number per window, then given
up (pdserve/launcher.py applies it to every child).

    exit 1 ──▶ restart after backoff_s            (0.5 s)
    exit 2 ──▶ restart after 2 × backoff_s        (1 s)        within `window_s` (60 s) of each other
    ...                                                         the delay doubles, up to max_backoff_s
    exit max_restarts + 1 within the window ──▶ given up: not restarted again

Only restarts inside the last `window_s` count, so a worker that crashes once an hour is restarted every time,
after `backoff_s`. Torch-free and clock-injected, so it is tested without processes
(tests/pdserve/test_supervision.py).
"""

from __future__ import annotations

import collections
import signal
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.launch_plan import ChildSpec


PORT_TAKEN_EXIT = 98  # a worker's exit status when a port it was given is bound by another process (EADDRINUSE)


@dataclass(frozen=True)
class RestartPolicy:
    """`max_restarts` restarts of one child within any `window_s`; 0 never restarts (an exit gives it up)."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5  # before the first restart in a window; doubled for each restart since
    max_backoff_s: float = 16.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"restart window {self.window_s} s must be positive and 0 <= backoff {self.backoff_s} s "
                             f"<= max backoff {self.max_backoff_s} s")


@dataclass
class RestartHistory:
    """The restarts of one child inside the policy's window: what the next exit earns."""

    policy: RestartPolicy
    restarts: collections.deque[float] = field(default_factory=collections.deque)

    def recent(self, now: float) -> int:
        while self.restarts and now - self.restarts[0] > self.policy.window_s:
            self.restarts.popleft()
        return len(self.restarts)

    def delay(self, now: float) -> float | None:
        """Seconds to wait before restarting a child that exited at `now`; None: give it up."""
        count = self.recent(now)
        if count >= self.policy.max_restarts:
            return None
        return min(self.policy.max_backoff_s, self.policy.backoff_s * 2.0 ** count)

    def restarted(self, now: float) -> None:
        self.restarts.append(now)


@dataclass
class Child:
    """One child of the launcher: what it runs now (`spec`, `process`: both replaced by a restart) and where it
    stands: running, exited and waiting for its restart (`restart_at`), or given up."""

    spec: ChildSpec
    process: subprocess.Popen[bytes]
    history: RestartHistory
    restart_at: float | None = None  # exited: restarted at this time.monotonic()
    given_up: bool = False
    restarted_at: float | None = None  # restarted, and not yet healthy again
    restarts: int = 0  # in its whole life

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def running(self) -> bool:
        return self.restart_at is None and not self.given_up and self.process.poll() is None


def describe_exit(code: int) -> str:
    """'status 1' / 'signal SIGKILL' for a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"
