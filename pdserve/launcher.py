"""Local launcher for `pdserve serve`: a router plus prefill and decode workers, each its own process, supervised.

The plan (command lines, ports, GPUs) is pdserve/launch_plan.py; this module starts it and supervises it.

Every child is a `pdserve <role>` command line, so `ps` shows the roles. Readiness: each router answers
`/health` at all (it listens), then every child's `/health` says 200 (a router: it has a prefill and a decode
worker; a worker: it is registered). None of these needs the API key.

Ports: every router's address is bound here before any child starts (one in use fails `pdserve serve` at
once) and held until the launcher stops; each start of a router inherits its socket (pdserve/listeners.py).
A worker that finds a port chosen for it bound by another process first exits with PORT_TAKEN_EXIT
(pdserve/supervision.py) and is started again on fresh ports, even before the deployment is ready (at most
_PORT_RETRIES times).

Supervision, once the deployment is ready (any other child that exits before that fails `pdserve serve`: a
wrong flag or a missing model would only fail again):
- a child that exits is restarted after a backoff (pdserve/supervision.py: 0.5 s, doubling, at most
  `--max-restarts` per minute, then given up with a log line); the others keep serving meanwhile. The router
  sees a dead worker at once (its data-plane connection breaks: the worker is skipped until it registers
  again), and a restarted worker registers under the same worker id, on fresh ports (its old ones may have
  been taken meanwhile), so the router replaces its link and routes to it again;
- a router is restarted too, on its own port (clients and workers know it; the launcher holds its listening
  socket throughout, pdserve/listeners.py): its registry is rebuilt from
  the workers' heartbeats (answered 404, they register again), so it costs the requests it held and keeps
  every worker's loaded model. Restarting it beats exiting, which would take every worker down with it;
- when a router is given up, or every worker of a role, nothing can serve any more: everything is stopped and
  `pdserve serve` exits 1, for systemd or Docker's restart policy to see.
No child outlives the launcher:
- SIGINT / SIGTERM to the launcher: SIGTERM to every child, SIGKILL to any still alive after `grace_s`;
  a restart still waiting for its backoff is not made;
- the launcher killed outright (SIGKILL): each child was started with PR_SET_PDEATHSIG, so the kernel sends it
  SIGTERM when the launcher dies (Linux; elsewhere the first two still hold).
The children share the launcher's process group, so Ctrl-C in a terminal reaches all of them at once too.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.launch_plan import ChildSpec, plan_children
from pdserve.listeners import ListenError, RouterListeners
from pdserve.settings import LaunchSettings
from pdserve.supervision import PORT_TAKEN_EXIT, Child, RestartHistory, describe_exit

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2  # how often the launcher looks at its children (a dead worker is routed around at once anyway)
_PORT_RETRIES = 3  # starts on fresh ports for a worker whose chosen port another process took before it bound


def _load_prctl() -> Callable[[int, int], int] | None:
    """libc's prctl, looked up now: the child between fork and exec only calls it (no dlopen there, which
    could deadlock when another thread of the parent held the loader's lock)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel for SIGTERM when the launcher dies (no effect where prctl is missing). The
    kernel sends it when the *thread* that started the child ends: the launcher starts every child from the
    thread that supervises them (run_launcher's main thread)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(spec: ChildSpec, env: dict[str, str] | None,
          log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start one child; with `log_path` its stdout and stderr go there (appended: a restart adds to it). A
    router inherits the listening sockets its --fd flags name (pdserve/listeners.py)."""
    preexec = _die_with_parent if sys.platform == "linux" else None
    if log_path is None:
        return subprocess.Popen(spec.argv, preexec_fn=preexec, env=env, pass_fds=spec.fds)  # noqa: PLW1509
    with log_path.open("ab") as log:
        return subprocess.Popen(spec.argv, preexec_fn=preexec, env=env, pass_fds=spec.fds,  # noqa: PLW1509
                                stdout=log, stderr=subprocess.STDOUT)


def _print(line: str) -> None:
    print(line, flush=True)


class DeploymentLost(Exception):
    """Nothing can serve any more: a router or every worker of a role was given up."""


class Launcher:
    def __init__(self, settings: LaunchSettings, grace_s: float = 10.0, log: Callable[[str], None] = _print,
                 env: dict[str, str] | None = None, log_dir: Path | None = None) -> None:
        """`env`: the children's whole environment (None: the launcher's own); `pdserve serve` passes its
        own plus the internal API's shared secret, so the secret never appears on a command line.
        `log_dir`: each child's output to <log_dir>/<name>.log (None: the launcher's own stdout/stderr)."""
        self.settings = settings
        self.grace_s = grace_s
        self.log = log
        self.env = env
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._stop = threading.Event()
        self._client: httpx.Client | None = None
        self.listeners = RouterListeners()

    def child(self, name: str) -> Child:
        return next(child for child in self.children if child.name == name)

    def log_path(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def start(self) -> None:
        """Bind every router's address (a port in use fails here, before any child runs), then start all."""
        try:
            planned = plan_children(self.settings)  # takes free ports on --host: fails if it is no address here
        except OSError as exc:
            raise ListenError(f"cannot listen on --host {self.settings.host}: {exc}") from None
        specs = [self.listeners.bind(spec, self.settings.host) for spec in planned]
        for spec in specs:
            if self._stop.is_set():
                raise InterruptedError("stopping before the deployment was started")
            process = spawn(spec, self.env, self.log_path(spec.name))
            self.children.append(Child(spec, process, RestartHistory(self.settings.restart)))
            self.log(f"started {spec.name} (pid {process.pid}): {' '.join(spec.argv[3:])}")
        # the workers start beside the routers, not after them: their ports are known, and a worker retries
        # its registration until its router listens (on a busy 2-core machine a router took 2-3 s to listen,
        # which every start waited through before its workers began loading)
        routers = [child.name for child in self.children if child.spec.up_url is not None]
        self._wait_for(routers, self.settings.ready_timeout_s, listening=True)

    def wait_ready(self) -> None:
        self._wait_for([child.name for child in self.children], self.settings.ready_timeout_s)
        scheme = "https" if self.settings.router_tls else "http"
        self.log(f"pdserve ready: {scheme}://{self.settings.host}:{self.settings.port}/v1 "
                 f"({', '.join(child.name for child in self.children)})")

    def _wait_for(self, names: list[str], timeout_s: float, listening: bool = False) -> None:
        """Until each named child's health URL answers 200 (`listening`: a router's answers at all). A child's
        URL is looked up each time: one started again on fresh ports has a new one."""
        deadline = time.monotonic() + timeout_s
        pending = list(names)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                if self._stop.is_set():
                    raise InterruptedError("stopping before the deployment was ready")
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not ready after {timeout_s:g} s: {sorted(pending)}")
                pending = [name for name in pending if not _answers(client, self._ready_url(name, listening),
                                                                    listening)]
                if pending:
                    self._stop.wait(0.2)

    def _ready_url(self, name: str, listening: bool) -> str:
        spec = self.child(name).spec
        return spec.up_url if listening and spec.up_url else spec.health_url

    def _check_alive(self) -> None:
        """Before the deployment is ready, an exit fails it (a wrong flag or a missing model would only fail
        again), except a worker's PORT_TAKEN_EXIT: another process bound a port chosen for it between the
        choice and its bind, so it is started again on fresh ports, at most _PORT_RETRIES times."""
        for child in self.children:
            code = child.process.poll()
            if code is None:
                continue
            if code == PORT_TAKEN_EXIT and child.spec.role != "router" and child.restarts < _PORT_RETRIES:
                old = urlsplit(child.spec.health_url).port
                self._respawn(child)
                self.log(f"{child.name}: a port chosen for it was taken by another process before it bound it "
                         f"(port {old} or its transfer port); started again (pid {child.process.pid}, port "
                         f"{urlsplit(child.spec.health_url).port})")
                continue
            raise ChildProcessError(f"{child.name} (pid {child.process.pid}) exited with {describe_exit(code)}")

    def wait(self) -> int:
        """Supervise until a stop is requested (0) or nothing can serve any more (1)."""
        self._client = httpx.Client(timeout=0.5, trust_env=False)
        try:
            while not self._stop.wait(_POLL_S):
                try:
                    self.supervise(time.monotonic())
                except DeploymentLost as exc:
                    self.log(f"pdserve serve: {exc}; stopping everything")
                    return 1
            return 0
        finally:
            self._client.close()

    def supervise(self, now: float) -> None:
        """One look at every child: note exits, make the restarts that are due, log the ones back."""
        for child in self.children:
            if child.given_up:
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child, now)
                continue
            code = child.process.poll()
            if code is not None:
                self._exited(child, code, now)
            elif child.restarted_at is not None and self._client is not None \
                    and _answers(self._client, child.spec.health_url):
                self.log(f"{child.name} is back (pid {child.process.pid}), {now - child.restarted_at:.1f} s "
                         f"after its restart")
                child.restarted_at = None
        self._check_serving()

    def _exited(self, child: Child, code: int, now: float) -> None:
        pid, policy = child.process.pid, self.settings.restart
        delay = child.history.delay(now)
        if delay is None:
            child.given_up = True
            self.log(f"{child.name} (pid {pid}) exited with {describe_exit(code)}; it was restarted "
                     f"{child.history.recent(now)} times within {policy.window_s:g} s (--max-restarts "
                     f"{policy.max_restarts}): giving it up, the others keep serving")
            return
        child.restart_at = now + delay
        self.log(f"{child.name} (pid {pid}) exited with {describe_exit(code)}; restarting it in {delay:g} s "
                 f"(restart {child.history.recent(now) + 1} of at most {policy.max_restarts} within "
                 f"{policy.window_s:g} s); the others keep serving")

    def _restart(self, child: Child, now: float) -> None:
        self._respawn(child)
        child.history.restarted(now)
        child.restart_at, child.restarted_at = None, now
        port = urlsplit(child.spec.health_url).port
        self.log(f"restarted {child.name} (pid {child.process.pid}, port {port})")

    def _respawn(self, child: Child) -> None:
        """Start `child` again; a worker on fresh ports, none of them another child's."""
        others = {port for other in self.children if other is not child for port in other.spec.ports}
        child.spec = child.spec.with_fresh_ports(self.settings.host, others)
        child.process = spawn(child.spec, self.env, self.log_path(child.name))
        child.restarts += 1

    def _check_serving(self) -> None:
        for child in self.children:
            if child.given_up and child.spec.role == "router":
                raise DeploymentLost(f"{child.name} was given up")
        workers = [child for child in self.children if child.spec.role != "router"]
        for role in ("prefill", "decode"):
            serving = [c for c in workers if c.spec.role in (role, "both")]
            if serving and all(c.given_up for c in serving):
                raise DeploymentLost(f"every {role} worker was given up ({', '.join(c.name for c in serving)})")

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """SIGTERM every child (workers first, the router last), SIGKILL what outlives the grace period."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in self.children:
            process = child.process
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{child.name} (pid {process.pid}) ignored SIGTERM for {self.grace_s:g} s: SIGKILL")
                process.kill()
                process.wait()
        self.listeners.close()


def _answers(client: httpx.Client, url: str, listening: bool = False) -> bool:
    """200 from `url` (`listening`: any HTTP answer, e.g. a router's 503 before its workers registered)."""
    try:
        status = client.get(url).status_code
    except httpx.HTTPError:
        return False
    return listening or status == 200


def run_launcher(settings: LaunchSettings, env: dict[str, str] | None = None) -> int:
    launcher = Launcher(settings, env=env)
    previous = {sig: signal.signal(sig, lambda *_: launcher.request_stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher.start()
        launcher.wait_ready()
        return launcher.wait()
    except (ChildProcessError, TimeoutError, ListenError) as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 1
    except InterruptedError:
        return 0
    finally:
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
