"""Local launcher for `pdserve serve`: a router plus prefill and decode workers, each its own process, supervised.

    pdserve serve ─┬─ pdserve router  --port 8000                       (all started at once)
                   ├─ pdserve prefill --router http://127.0.0.1:8000 --port <free> --worker-id prefill-0
                   └─ pdserve decode  --router http://127.0.0.1:8000 --port <free> --transfer-port <free> ...
                   (--colocated: one `pdserve decode --role both` instead of the two workers;
                    --num-colocated N: N of them, round-robin over the GPUs;
                    --num-routers N: N routers, the first on --port, and every worker registers with each:
                    --router http://127.0.0.1:8000,http://127.0.0.1:<free>, as a headless Service does in
                    Kubernetes, deploy/k8s)

Every child is a `pdserve <role>` command line, so `ps` shows the roles. Readiness: each router answers
`/health` at all (it listens), then every child's `/health` says 200 (a router: it has a prefill and a decode
worker; a worker: it is registered). None of these needs the API key.

Ports: the launcher chooses every child's ports before any child binds one, each free now and none chosen
twice (nor the router's --port). Another process can still bind one first; the worker then exits with
PORT_TAKEN_EXIT (pdserve/supervision.py) and is started again on fresh ports, even before the deployment is
ready (at most _PORT_RETRIES times).

Supervision, once the deployment is ready (any other child that exits before that fails `pdserve serve`: a
wrong flag or a missing model would only fail again):
- a child that exits is restarted after a backoff (pdserve/supervision.py: 0.5 s, doubling, at most
  `--max-restarts` per minute, then given up with a log line); the others keep serving meanwhile. The router
  sees a dead worker at once (its data-plane connection breaks: the worker is skipped until it registers
  again), and a restarted worker registers under the same worker id, on fresh ports (its old ones may have
  been taken meanwhile), so the router replaces its link and routes to it again;
- a router is restarted too, on its own port (clients and workers know it): its registry is rebuilt from
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
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.settings import LaunchSettings
from pdserve.supervision import PORT_TAKEN_EXIT, Child, RestartHistory, describe_exit

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2  # how often the launcher looks at its children (a dead worker is routed around at once anyway)
_PORT_FLAGS = ("--port", "--transfer-port")  # the ports a worker gets afresh when it is restarted
_PORT_RETRIES = 3  # starts on fresh ports for a worker whose chosen port another process took before it bound


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    health_url: str  # 200 once it can serve (the router: once it has a prefill and a decode worker)
    up_url: str | None = None  # a router: answers at all once it listens
    role: str = "router"  # router | prefill | decode | both

    @property
    def ports(self) -> set[int]:
        """The ports its command line names (--port, --transfer-port, a router's --internal-port)."""
        return {int(self.argv[i + 1]) for i, arg in enumerate(self.argv[:-1])
                if arg in (*_PORT_FLAGS, "--internal-port")}

    def with_fresh_ports(self, host: str, avoid: Collection[int] = ()) -> ChildSpec:
        """A worker's spec for its restart: new --port and --transfer-port, none of them its old ones or in
        `avoid` (the other children's). A router keeps its own."""
        if self.role == "router":
            return self
        argv = list(self.argv)
        taken = set(avoid) | self.ports
        for flag in _PORT_FLAGS:
            if flag in argv:
                argv[argv.index(flag) + 1] = str(free_port(host, taken))
        port = argv[argv.index("--port") + 1]
        return replace(self, argv=argv, health_url=f"http://{host}:{port}/health")


def free_port(host: str = "127.0.0.1", taken: set[int] | None = None) -> int:
    """A port nothing listens on now (every deployment, test and benchmark takes its ports from here). With
    `taken`: none of those either, and the one returned is added to it. A launcher chooses all its children's
    ports before any of them binds, so "nothing listens" alone gave one port twice: the kernel handed the
    router's --port (chosen by the caller, its router still starting) to a decode worker as well, which
    could not bind it (CI, 2026-12-06)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if taken is None:
            return port
        if port not in taken:
            taken.add(port)
            return port


def plan_children(settings: LaunchSettings, python: str = sys.executable,
                  num_gpus: int | None = None) -> list[ChildSpec]:
    """The router first, then the workers, with ports chosen now and GPUs shared out (`num_gpus`: None asks
    torch; 0 on a machine without CUDA)."""
    base = [python, "-m", "pdserve.cli"]
    taken = {settings.port}  # every port chosen here, so none is chosen twice
    children = router_children(settings, base, taken)
    router_url = ",".join(child.health_url.removesuffix("/health") for child in children)
    if settings.colocated:
        workers = [("decode", "both", i) for i in range(settings.num_colocated)]
    else:
        workers = [("prefill", "prefill", i) for i in range(settings.num_prefill)]
        workers += [("decode", "decode", i) for i in range(settings.num_decode)]
    extra = list(settings.worker_args)
    if "--torch-threads" not in extra:
        # split the cores between the workers: on 2 busy cores, SmolLM2-135M generation took 1.3-19.6 s with
        # two torch threads (spinning threads contend) and a steady 2.5 s with one
        # (tests/decode_node/test_decode_engine.py)
        extra += ["--torch-threads", str(max(1, (os.cpu_count() or 1) // len(workers)))]
    device = _flag(extra, "--device", "auto")
    if num_gpus is None and device.startswith(("auto", "cuda")):
        num_gpus = _cuda_device_count()
    placements = place_on_gpus(extra, len(workers), num_gpus or 0)
    extra += transfer_flags(settings, on_gpus=device.startswith("cuda") or (device == "auto" and bool(num_gpus)))
    for (command, role, index), placement in zip(workers, placements, strict=True):
        port = free_port(settings.host, taken)
        name = f"{'colocated' if role == 'both' else role}-{index}"
        argv = [*base, command, "--role", role, "--router", router_url, "--host", settings.host,
                "--port", str(port), "--worker-id", name]
        if role != "prefill":
            argv += ["--transfer-port", str(free_port(settings.host, taken))]
        children.append(ChildSpec(name, argv + extra + placement, f"http://{settings.host}:{port}/health",
                                  role=role))
    return children


def router_children(settings: LaunchSettings, base: list[str], taken: set[int]) -> list[ChildSpec]:
    """The routers: `router` on --port, then `router-1`, ... on free ports (none in `taken`, each added to it).
    With TLS, workers and health checks use each router's plain loopback listener (--internal-port,
    pdserve/router_server.py)."""
    ports = [settings.port] + [free_port(settings.host, taken) for _ in range(settings.num_routers - 1)]
    children = []
    for index, port in enumerate(ports):
        url = f"http://{settings.host}:{port}"
        argv = [*base, "router", "--host", settings.host, "--port", str(port), *settings.router_args]
        if settings.router_tls:
            internal = free_port("127.0.0.1", taken)
            url = f"http://127.0.0.1:{internal}"
            argv += ["--internal-port", str(internal)]
        children.append(ChildSpec("router" if index == 0 else f"router-{index}", argv, f"{url}/health",
                                  f"{url}/health"))
    return children


def transfer_flags(settings: LaunchSettings, on_gpus: bool) -> list[str]:
    """P and D on this host's GPUs write KV straight into each other's pools (cuda_ipc) unless told otherwise;
    on CPUs the workers' own default (tcp) holds. A colocated worker has no transfer."""
    if settings.colocated:
        return []
    if settings.transfer_backend == "auto":
        return ["--transfer-backend", "cuda_ipc"] if on_gpus else []
    return ["--transfer-backend", settings.transfer_backend]


def place_on_gpus(worker_args: list[str], num_workers: int, num_gpus: int) -> list[list[str]]:
    """Extra flags per worker: round-robin over the GPUs (`--device cuda:i`), and when k workers share one,
    `--gpu-memory-utilization 0.8/k` each (unless the flags already say). Nothing on a machine without CUDA."""
    device = _flag(worker_args, "--device", "auto")
    if device == "cpu" or not device.startswith(("auto", "cuda")):
        return [[] for _ in range(num_workers)]
    if num_gpus == 0:
        return [[] for _ in range(num_workers)]
    devices = [device] * num_workers if device.startswith("cuda:") else [f"cuda:{i % num_gpus}"
                                                                        for i in range(num_workers)]
    sized = any(flag in worker_args for flag in ("--num-blocks", "--kv-cache-memory", "--gpu-memory-utilization"))
    placements = []
    for dev in devices:
        flags = [] if dev == device else ["--device", dev]
        if not sized and devices.count(dev) > 1:
            flags += ["--gpu-memory-utilization", f"{0.8 / devices.count(dev):.3f}"]
        placements.append(flags)
    return placements


def _flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _cuda_device_count() -> int:
    """The CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies), asked of the driver itself:
    importing torch for it took the launcher 1.5-3 s on a busy 2-core machine before the router could start.
    0 where there is no driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


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
    """Start one child; with `log_path` its stdout and stderr go there (appended: a restart adds to it)."""
    preexec = _die_with_parent if sys.platform == "linux" else None
    if log_path is None:
        return subprocess.Popen(spec.argv, preexec_fn=preexec, env=env)  # noqa: PLW1509
    with log_path.open("ab") as log:
        return subprocess.Popen(spec.argv, preexec_fn=preexec, env=env, stdout=log,  # noqa: PLW1509
                                stderr=subprocess.STDOUT)


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

    def child(self, name: str) -> Child:
        return next(child for child in self.children if child.name == name)

    def log_path(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def start(self) -> None:
        for spec in plan_children(self.settings):
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
    except (ChildProcessError, TimeoutError) as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 1
    except InterruptedError:
        return 0
    finally:
        launcher.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
