"""What `pdserve serve` starts: each child's command line, ports and GPU, chosen before any of them runs
(pdserve/launcher.py starts and supervises them).

    pdserve serve ─┬─ pdserve router  --port 8000                       (all started at once)
                   ├─ pdserve prefill --router http://127.0.0.1:8000 --port <free> --worker-id prefill-0
                   └─ pdserve decode  --router http://127.0.0.1:8000 --port <free> --transfer-port <free> ...
                   (--colocated: one `pdserve decode --role both` instead of the two workers;
                    --num-colocated N: N of them, round-robin over the GPUs;
                    --num-routers N: N routers, the first on --port, and every worker registers with each:
                    --router http://127.0.0.1:8000,http://127.0.0.1:<free>, as a headless Service does in
                    Kubernetes, deploy/k8s)

Ports: the launcher chooses every child's ports before any child binds one, each free now and none chosen
twice (nor the router's --port). A router's are bound by the launcher itself before any child starts and
inherited (pdserve/listeners.py). A worker's can still be bound by another process first; the worker
then exits with PORT_TAKEN_EXIT (pdserve/supervision.py) and is started again on fresh ports, even before the
deployment is ready (pdserve/launcher.py, at most _PORT_RETRIES times).
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace

from pdserve.settings import LaunchSettings

_PORT_FLAGS = ("--port", "--transfer-port")  # the ports a worker gets afresh when it is restarted
_FD_FLAGS = ("--fd", "--internal-fd")  # a router's listening sockets, the launcher's (pdserve/listeners.py)


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

    @property
    def fds(self) -> tuple[int, ...]:
        """The inherited sockets its command line names (a router's --fd, --internal-fd)."""
        return tuple(int(self.argv[i + 1]) for i, arg in enumerate(self.argv[:-1]) if arg in _FD_FLAGS)

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
