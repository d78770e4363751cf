"""Local launcher for `pdserve serve`: a router plus prefill and decode workers, each its own process.

    pdserve serve ─┬─ pdserve router  --port 8000                       (started first)
                   ├─ pdserve prefill --router http://127.0.0.1:8000 --port <free> --worker-id prefill-0
                   └─ pdserve decode  --router http://127.0.0.1:8000 --port <free> --transfer-port <free> ...
                   (--colocated: one `pdserve decode --role both` instead of the two workers;
                    --num-colocated N: N of them, round-robin over the GPUs;
                    --num-routers N: N routers, the first on --port, and every worker registers with each:
                    --router http://127.0.0.1:8000,http://127.0.0.1:<free>, as a headless Service does in
                    Kubernetes, deploy/k8s)

Every child is a `pdserve <role>` command line, so `ps` shows the roles. No child outlives the launcher:
- SIGINT / SIGTERM to the launcher: SIGTERM to every child, SIGKILL to any still alive after `grace_s`;
- a child that exits on its own takes the whole deployment down (exit status 1), rather than leaving a router
  without workers;
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
from dataclasses import dataclass

import httpx

from pdserve.settings import LaunchSettings

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    health_url: str  # 200 once it can serve (the router: once it has a prefill and a decode worker)
    up_url: str | None = None  # 200 once it listens (workers are started after the router is up)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def plan_children(settings: LaunchSettings, python: str = sys.executable,
                  num_gpus: int | None = None) -> list[ChildSpec]:
    """The router first, then the workers, with ports chosen now and GPUs shared out (`num_gpus`: None asks
    torch; 0 on a machine without CUDA)."""
    base = [python, "-m", "pdserve.cli"]
    children = router_children(settings, base)
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
        port = free_port(settings.host)
        name = f"{'colocated' if role == 'both' else role}-{index}"
        argv = [*base, command, "--role", role, "--router", router_url, "--host", settings.host,
                "--port", str(port), "--worker-id", name]
        if role != "prefill":
            argv += ["--transfer-port", str(free_port(settings.host))]
        children.append(ChildSpec(name, argv + extra + placement, f"http://{settings.host}:{port}/health"))
    return children


def router_children(settings: LaunchSettings, base: list[str]) -> list[ChildSpec]:
    """The routers: `router` on --port, then `router-1`, ... on free ports. With TLS, workers and health checks
    use each router's plain loopback listener (--internal-port, pdserve/router_server.py)."""
    ports = [settings.port] + [free_port(settings.host) for _ in range(settings.num_routers - 1)]
    children = []
    for index, port in enumerate(ports):
        url = f"http://{settings.host}:{port}"
        argv = [*base, "router", "--host", settings.host, "--port", str(port), *settings.router_args]
        if settings.router_tls:
            internal = free_port("127.0.0.1")
            url = f"http://127.0.0.1:{internal}"
            argv += ["--internal-port", str(internal)]
        children.append(ChildSpec("router" if index == 0 else f"router-{index}", argv, f"{url}/health",
                                  f"{url}/v1/models"))
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
    import torch  # here only: the launcher itself needs no torch otherwise

    return torch.cuda.device_count()


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel for SIGTERM when the launcher dies (no effect where prctl is missing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Launcher:
    def __init__(self, settings: LaunchSettings, grace_s: float = 10.0, log=print,
                 env: dict[str, str] | None = None) -> None:
        """`env`: the children's whole environment (None: the launcher's own); `pdserve serve` passes its
        own plus the internal API's shared secret, so the secret never appears on a command line."""
        self.settings = settings
        self.grace_s = grace_s
        self.log = log
        self.env = env
        self.children: list[tuple[ChildSpec, subprocess.Popen]] = []
        self._stop = threading.Event()

    def start(self) -> None:
        for spec in plan_children(self.settings):
            if self._stop.is_set():
                raise InterruptedError("stopping before the deployment was started")
            # preexec_fn is safe here: the launcher runs a single thread
            preexec = _die_with_parent if sys.platform == "linux" else None
            process = subprocess.Popen(spec.argv, preexec_fn=preexec, env=self.env)  # noqa: PLW1509
            self.children.append((spec, process))
            self.log(f"started {spec.name} (pid {process.pid}): {' '.join(spec.argv[3:])}")
            if spec.up_url is not None:
                self._wait_for([spec.up_url], [spec.name], self.settings.ready_timeout_s)

    def wait_ready(self) -> None:
        specs = [spec for spec, _ in self.children]
        self._wait_for([s.health_url for s in specs], [s.name for s in specs], self.settings.ready_timeout_s)
        scheme = "https" if self.settings.router_tls else "http"
        self.log(f"pdserve ready: {scheme}://{self.settings.host}:{self.settings.port}/v1 "
                 f"({', '.join(spec.name for spec, _ in self.children)})")

    def _wait_for(self, urls: list[str], names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(zip(urls, names, strict=True))
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                if self._stop.is_set():
                    raise InterruptedError("stopping before the deployment was ready")
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not ready after {timeout_s:g} s: {sorted(pending.values())}")
                pending = {url: name for url, name in pending.items() if not _healthy(client, url)}
                if pending:
                    self._stop.wait(0.2)

    def _check_alive(self) -> None:
        for spec, process in self.children:
            code = process.poll()
            if code is not None:
                raise ChildProcessError(f"{spec.name} (pid {process.pid}) exited with status {code}")

    def wait(self) -> int:
        """Block until a stop is requested (0) or a child exits on its own (1)."""
        while not self._stop.wait(0.5):
            try:
                self._check_alive()
            except ChildProcessError as exc:
                self.log(f"{exc}; stopping everything")
                return 1
        return 0

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """SIGTERM every child (workers first, the router last), SIGKILL what outlives the grace period."""
        for _, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for spec, process in self.children:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{spec.name} (pid {process.pid}) ignored SIGTERM for {self.grace_s:g} s: SIGKILL")
                process.kill()
                process.wait()


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


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
