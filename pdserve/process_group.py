"""A deployment's process in its own session (process group), its output in a log file: how the tests and the
benchmarks start `pdserve serve`, compose's services as local processes, and pinned workers.

    group = ProcessGroup(serve_command(port, flags), log_path, env).start()
    group.wait_until(lambda: http_ok(url + "/health"), 240, "the deployment")   raises if it exits first
    ...
    group.stop()      SIGTERM to the whole group (the launcher stops its children), SIGKILL after the grace
    group.kill()      SIGKILL to the whole group: whatever is left, at once

`pdserve serve` itself (pdserve/launcher.py) starts its children with `spawn`, tied to its own life; a
ProcessGroup is for a caller that must be able to take down everything a command started, whatever state
it is in. One definition, so no test or benchmark has a harness of its own for it (issue 21).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx


def serve_command(port: int, flags: list[str]) -> list[str]:
    """`pdserve serve` on 127.0.0.1:`port` as this interpreter runs it."""
    return [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *flags]


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """`url` answers 200 now."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ProcessGroup:
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None  # the whole environment (None: ours)
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> ProcessGroup:
        with self.log_path.open("wb") as log:  # a fresh log: its "ready" line is this start's
            self.popen = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, "not started"
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def exited(self) -> bool:
        return self.returncode is not None

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
        """Poll `ready` until it holds; RuntimeError if the process exits first, TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.exited():
                raise RuntimeError(f"{' '.join(self.argv[:6])} exited with {self.returncode} before {what} was "
                                   f"ready:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout_s:g} s:\n{self.log()}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the group, then SIGKILL to what is left after `grace_s`."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL to the group (its leader may be gone while children live on)."""
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def children(self) -> list[int]:
        """Every process whose parent is this one (read from /proc: no psutil needed)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.pid:
                    pids.append(int(entry.name))
        return pids

    def signal(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
