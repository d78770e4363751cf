"""The launcher's supervision (pdserve/launcher.py, pdserve/supervision.py): the restart policy on a fake clock,
then the launcher's own loop over real child processes — small HTTP servers that answer /health, standing in
for pdserve's children so that a restart costs milliseconds, not a model load. pdserve's own children under the
same loop are killed in tests/reliability/test_worker_failures.py."""

from __future__ import annotations

import errno
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest

from pdserve.launch_plan import ChildSpec, free_port
from pdserve.launcher import Launcher, spawn
from pdserve.listeners import ListenError
from pdserve.settings import LaunchSettings
from pdserve.supervision import PORT_TAKEN_EXIT, Child, RestartHistory, RestartPolicy, describe_exit

SERVER = f"""
import errno, http.server, socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
if "--fd" in sys.argv:  # the launcher's socket, as `pdserve router --fd` serves on it (pdserve/router_server.py)
    server = http.server.HTTPServer(("127.0.0.1", port), Health, bind_and_activate=False)
    server.socket = socket.socket(fileno=int(sys.argv[sys.argv.index("--fd") + 1]))
else:
    try:
        server = http.server.HTTPServer(("127.0.0.1", port), Health)
    except OSError as exc:  # as a pdserve worker does (worker/app.py)
        sys.exit({PORT_TAKEN_EXIT} if exc.errno == errno.EADDRINUSE else 1)
server.serve_forever()
"""
CRASH = "import sys; sys.exit(3)"


def test_backoff_doubles_then_the_child_is_given_up_and_old_restarts_leave_the_window() -> None:
    history = RestartHistory(RestartPolicy(max_restarts=4, window_s=60, backoff_s=0.5, max_backoff_s=2))
    delays = []
    for now in (0.0, 1.0, 2.0, 3.0):
        delays.append(history.delay(now))
        history.restarted(now)
    assert delays == [0.5, 1.0, 2.0, 2.0]  # doubling, capped at max_backoff_s
    assert history.delay(4.0) is None  # a fifth exit within the minute: given up
    assert history.delay(61.5) == 2.0  # the restarts at 0 and 1 s left the window: two remain
    assert history.delay(63.5) == 0.5  # none in the last minute: back to the first backoff
    assert RestartHistory(RestartPolicy(max_restarts=0)).delay(0.0) is None
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


def test_exit_codes_are_told_as_signals_or_statuses() -> None:
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(3) == "status 3"


def _spec(name: str, role: str, script: str = SERVER) -> ChildSpec:
    port = free_port("127.0.0.1")
    return ChildSpec(name, [sys.executable, "-c", script, role, "--port", str(port)],
                     f"http://127.0.0.1:{port}/health", role=role)


class Supervised:
    """A Launcher over given children, supervising in a thread as `pdserve serve` does in its main thread; a
    router serves on the launcher's socket (--fd), as under `pdserve serve`."""

    def __init__(self, specs: list[ChildSpec], policy: RestartPolicy, log_dir: Path) -> None:
        self.lines: list[str] = []
        self.launcher = Launcher(LaunchSettings(restart=policy), grace_s=5, log=self.lines.append, log_dir=log_dir)
        for spec in specs:
            spec = self.launcher.listeners.bind(spec, "127.0.0.1")  # a router: as Launcher.start binds it
            process = spawn(spec, None, self.launcher.log_path(spec.name))
            self.launcher.children.append(Child(spec, process, RestartHistory(policy)))
        self.result: list[int] = []
        self.thread = threading.Thread(target=lambda: self.result.append(self.launcher.wait()), daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.launcher.request_stop()
        self.thread.join(10)
        self.launcher.stop()

    def wait_for(self, text: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no log line with {text!r} after {timeout_s} s: {self.lines}")


@pytest.fixture
def healthy_specs() -> Iterator[list[ChildSpec]]:
    yield [_spec("router", "router"), _spec("prefill-0", "prefill"), _spec("decode-0", "decode"),
           _spec("decode-1", "decode")]


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_worker_is_restarted_on_fresh_ports_and_the_others_keep_running(
        healthy_specs: list[ChildSpec], tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=3, backoff_s=0.2)
    with Supervised(healthy_specs, policy, tmp_path) as run:
        launcher = run.launcher
        for child in launcher.children:
            deadline = time.monotonic() + 10
            while not _up(child.spec.health_url):
                assert time.monotonic() < deadline, child.name
                time.sleep(0.05)
        victim, router = launcher.child("decode-1"), launcher.child("router")
        others = {c.name: c.process.pid for c in launcher.children if c is not victim}
        old_url, old_pid = victim.spec.health_url, victim.process.pid
        victim.process.send_signal(signal.SIGKILL)
        assert "exited with signal SIGKILL; restarting it in 0.2 s" in run.wait_for("decode-1 (pid")
        run.wait_for("decode-1 is back")
        assert victim.process.pid != old_pid and victim.restarts == 1
        assert victim.spec.health_url != old_url and _up(victim.spec.health_url)  # fresh ports
        assert {c.name: c.process.pid for c in launcher.children if c is not victim} == others

        router_url, router_port = router.spec.health_url, router.spec.ports.pop()
        router.process.send_signal(signal.SIGKILL)
        router.process.wait()
        with socket.socket() as thief, pytest.raises(OSError) as taken:  # while it is down, its port is held
            thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            thief.bind(("127.0.0.1", router_port))
        assert taken.value.errno == errno.EADDRINUSE
        # a request made while it is down waits in the socket's backlog and is answered by the restart
        assert httpx.get(router_url, timeout=20).status_code == 200
        run.wait_for("router is back")
        assert router.spec.health_url == router_url  # a router keeps its port: clients and workers know it
    assert run.result == [0]  # stopped, not lost
    assert all(c.process.poll() is not None for c in launcher.children)


def test_a_child_that_keeps_exiting_is_given_up_and_a_role_with_none_left_ends_the_deployment(
        tmp_path: Path) -> None:
    specs = [_spec("router", "router"), _spec("prefill-0", "prefill"), _spec("decode-0", "decode", CRASH)]
    policy = RestartPolicy(max_restarts=2, backoff_s=0.05)
    with Supervised(specs, policy, tmp_path) as run:
        run.wait_for("giving it up")
        run.thread.join(10)
        assert run.result == [1]  # no decode worker left: nothing can serve
    assert run.launcher.child("decode-0").restarts == 2
    assert "every decode worker was given up (decode-0); stopping everything" in run.wait_for("stopping everything")
    assert (tmp_path / "decode-0.log").exists()


def test_a_stop_during_the_backoff_makes_no_restart(healthy_specs: list[ChildSpec], tmp_path: Path) -> None:
    policy = RestartPolicy(backoff_s=5.0, max_backoff_s=5.0)
    with Supervised(healthy_specs, policy, tmp_path) as run:
        victim = run.launcher.child("prefill-0")
        victim.process.send_signal(signal.SIGKILL)
        run.wait_for("restarting it in 5 s")
    assert victim.restarts == 0 and not any("restarted prefill-0" in line for line in run.lines)


def _held_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_worker_whose_port_was_taken_before_it_bound_starts_again_on_fresh_ports_before_ready(
        tmp_path: Path) -> None:
    """Another process binds a port the launcher chose for a worker first: the worker exits PORT_TAKEN_EXIT
    and the deployment still comes up, that worker on fresh ports. A router's port is bound by the launcher
    before any child starts (pdserve/listeners.py), so one in use fails the start there."""
    with _held_port() as held:
        port = held.getsockname()[1]
        taken = ChildSpec("decode-0", [sys.executable, "-c", SERVER, "decode", "--port", str(port)],
                          f"http://127.0.0.1:{port}/health", role="decode")
        run = Supervised([_spec("router", "router"), _spec("prefill-0", "prefill"), taken], RestartPolicy(),
                         tmp_path)
        try:
            run.launcher.wait_ready()
            decode = run.launcher.child("decode-0")
            assert decode.restarts == 1 and port not in decode.spec.ports and _up(decode.spec.health_url)
            assert any(f"decode-0: a port chosen for it was taken by another process before it bound it (port "
                       f"{port}" in line for line in run.lines)
        finally:
            run.launcher.stop()

        router = ChildSpec("router", [sys.executable, "-c", SERVER, "router", "--port", str(port)],
                           f"http://127.0.0.1:{port}/health", role="router")
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            Supervised([router, _spec("decode-0", "decode")], RestartPolicy(), tmp_path)  # before any child runs
