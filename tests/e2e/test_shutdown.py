"""`pdserve serve` stops every process it started on SIGTERM and on Ctrl-C (SIGINT): no orphan is left.

Runs after every other e2e test (see conftest.pytest_collection_modifyitems): it stops the session's
deployments.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.deployments import Deployment


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(pid, 0): it is gone as far as serving goes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_signal_stops_every_process(launched: dict[str, Deployment], sig: signal.Signals) -> None:
    deployment = launched["disaggregated" if sig == signal.SIGTERM else "colocated"].wait_ready()
    children = deployment.child_pids()
    assert len(children) == (3 if deployment.name == "disaggregated" else 2)  # router + workers
    started = time.monotonic()
    deployment.process.send_signal(sig)
    assert deployment.process.wait(timeout=30) == 0
    assert not [pid for pid in children if alive(pid)]
    deadline = time.monotonic() + 5
    while group_alive(deployment.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # reaped children may take a moment to leave the process group
    assert not group_alive(deployment.process.pid), "a process of the launcher's group survived"
    assert time.monotonic() - started < 30
