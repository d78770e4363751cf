"""The reliability deployment: a router, 2 prefill and 2 decode workers started by `pdserve serve`'s own launcher
(pdserve.launcher.Launcher, supervising in a thread as `pdserve serve` does in its main thread), so that a test
can kill (SIGKILL) or freeze (SIGSTOP) any of them, read their memory, and watch the launcher restart them.
A test may start extra processes of its own beside the deployment (a static worker, a fuzzing router, a worker
with Redis) through the launcher's `spawn`; those are not supervised.

Every process gets the internal API's shared secret and the router's API key by environment, as `pdserve serve
--api-key` hands them out (pdserve.commands.serve.child_environment), and runs under the pickle guard
(tests/reliability/pickle_guard): a pickle call in any of them is logged and refused, so the session's last
test can prove none happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from pdserve.commands.serve import child_environment
from pdserve.launch_plan import ChildSpec, free_port
from pdserve.launcher import Launcher, spawn
from pdserve.settings import LaunchSettings
from pdserve.supervision import Child, RestartHistory, RestartPolicy

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
SECRET = "reliability-secret-0123456789"
API_KEY = "sk-reliability-test"
ADMIN_TOKEN = "admin-reliability-test"
INTERNAL = {"X-PDServe-Secret": SECRET}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
GUARD_DIR = Path(__file__).resolve().parent / "pickle_guard"
# 256 blocks = 4,096 tokens of KV per worker (188 MB in fp32); one torch thread each: five model processes
# share the 2 cores of the CI machine. A short lease (renewed by every KV frame) so that stalls end quickly.
WORKER_FLAGS = ("--num-blocks", "256", "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
                "--torch-threads", "1", "--kv-lease-timeout", "4", "--max-queued-requests", "24")
MAX_INFLIGHT = 64  # the router's --max-inflight-requests
# heartbeats every 0.5 s, a worker silent for 4 s is dropped: a dead one is noticed sooner anyway (its
# connection breaks), and five model processes on two cores can stall a loop for seconds
ROUTER_FLAGS = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "4")
READY_TIMEOUT_S = 180.0
HOST = "127.0.0.1"


def wait_until(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout_s} s")
        time.sleep(poll_s)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def metric(proc: Proc, name: str) -> float:
    """A sample of the process's /metrics (summed over labels), 0 when absent."""
    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


@dataclass
class Proc:
    """A process: a launcher child (its process and ports change when the launcher restarts it) or an extra."""

    name: str
    role: str  # router | prefill | decode
    child: Child
    log_path: Path
    registered: bool = True  # registers with the router (else static: nobody routes to it)

    @property
    def process(self) -> subprocess.Popen:
        return self.child.process

    @property
    def port(self) -> int:
        return int(self._flag("--port"))

    @property
    def transfer_port(self) -> int | None:
        return int(self._flag("--transfer-port")) if "--transfer-port" in self.child.spec.argv else None

    def _flag(self, name: str) -> str:
        argv = self.child.spec.argv
        return argv[argv.index(name) + 1]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)  # a frozen process dies just the same, but be explicit
            self.signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@dataclass
class Cluster:
    tmp: Path
    cache_dir: Path
    pickle_log: Path
    launcher: Launcher | None = None
    extras: dict[str, Proc] = field(default_factory=dict)
    retired: list[Proc] = field(default_factory=list)
    launcher_log: list[str] = field(default_factory=list)
    ports: set[int] = field(default_factory=set)  # every port chosen for the cluster: none is chosen twice
    _supervisor: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(GUARD_DIR), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PDSERVE_CACHE_DIR": str(self.cache_dir), "PDSERVE_SECRET": SECRET,
               "PYTHONPATH": path, "PDSERVE_TEST_PICKLE_GUARD_LOG": str(self.pickle_log)}
        return child_environment(env, API_KEY, ADMIN_TOKEN)

    def _log(self, line: str) -> None:
        self.launcher_log.append(line)
        with (self.tmp / "launcher.log").open("a") as log:
            log.write(line + "\n")

    # ---- starting -------------------------------------------------------------------------------------

    def launch(self, *router_flags: str) -> None:
        """The deployment, as `pdserve serve --num-prefill 2 --num-decode 2` starts it; returns once the router
        is up (the workers load meanwhile: `wait_deployment` waits for them)."""
        settings = LaunchSettings(host=HOST, port=free_port(HOST, self.ports), num_prefill=2, num_decode=2,
                                  worker_args=WORKER_FLAGS, router_args=(*ROUTER_FLAGS, *router_flags),
                                  ready_timeout_s=READY_TIMEOUT_S, restart=RestartPolicy())
        self.launcher = Launcher(settings, grace_s=10, log=self._log, env=self.env(), log_dir=self.tmp)
        self.launcher.start()
        self.ports |= {port for child in self.launcher.children for port in child.spec.ports}

    def supervise(self) -> None:
        """Once ready: the launcher's supervision loop, in a thread."""
        assert self.launcher is not None
        self.launcher.wait_ready()
        self._supervisor = threading.Thread(target=self.launcher.wait, name="launcher", daemon=True)
        self._supervisor.start()

    def _spawn(self, name: str, role: str, argv: list[str], registered: bool) -> Proc:
        spec = ChildSpec(name, [sys.executable, "-m", "pdserve.cli", *argv], "", role=role)
        log_path = self.tmp / f"{name}.log"
        child = Child(spec, spawn(spec, self.env(), log_path), RestartHistory(RestartPolicy(max_restarts=0)))
        proc = Proc(name, role, child, log_path, registered)
        self.extras[name] = proc
        return proc

    def _port(self) -> int:
        """A port free now and not the cluster's already (a restarted child's new ones may be: a clash only
        costs that child a start on other ports)."""
        return free_port(HOST, self.ports)

    def spawn_router(self, name: str, *extra: str) -> Proc:
        """An extra router process (the caller's to stop)."""
        return self._spawn(name, "router", ["router", "--host", HOST, "--port", str(self._port()), *ROUTER_FLAGS,
                                            *extra], registered=False)

    def start_worker(self, role: str, name: str, *extra: str, register: bool = True) -> Proc:
        """An extra worker beside the deployment: registered with its router, or static (nobody routes to it)."""
        argv = [role, "--host", HOST, "--port", str(self._port()), "--worker-id", name, "--transfer-port",
                str(self._port()), *extra]
        if register:
            argv += ["--router", self.url]
        return self._spawn(name, role, argv, registered=register)

    def wait_ready(self, *procs: Proc, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Each answers /health (workers: registered), the router lists the registered ones."""
        def ready() -> bool:
            for proc in procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log()}")
            if not all(_healthy(f"{p.url}/health" if p.role != "router" else f"{p.url}/metrics") for p in procs):
                return False
            names = {w["worker_id"] for w in self.registry()}
            return all(p.name in names for p in procs if p.role != "router" and p.registered)

        wait_until(ready, timeout_s, f"{[p.name for p in procs]} ready", poll_s=0.25)

    def wait_deployment(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every child of the launcher running (restarted ones back) and registered, with its current data port."""
        def ready() -> bool:
            entries = {w["worker_id"]: w for w in self.registry()}
            for proc in self.deployment():
                if proc.child.given_up:
                    raise RuntimeError(f"the launcher gave {proc.name} up:\n{proc.log()}")
                if not proc.child.running or proc.child.restarted_at is not None:
                    return False
                entry = entries.get(proc.name)
                if proc.role != "router" and not (entry and entry["reachable"] and entry["url"] == proc.url):
                    return False
            return True

        wait_until(ready, timeout_s, "every process of the deployment running and registered", poll_s=0.2)

    # ---- talking to it --------------------------------------------------------------------------------

    def deployment(self) -> list[Proc]:
        """The launcher's children, router first."""
        assert self.launcher is not None
        return [Proc(c.name, "router" if c.spec.role == "router" else c.spec.role, c, self.tmp / f"{c.name}.log")
                for c in self.launcher.children]

    @property
    def router(self) -> Proc:
        return self.deployment()[0]

    @property
    def workers(self) -> dict[str, Proc]:
        """Every worker by name: the deployment's, then the extras."""
        procs = [p for p in self.deployment() if p.role != "router"] + [p for p in self.extras.values()
                                                                          if p.role != "router"]
        return {p.name: p for p in procs}

    @property
    def url(self) -> str:
        return self.router.url

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def registry(self) -> list[dict]:
        try:
            reply = httpx.get(f"{self.url}/internal/workers", headers=INTERNAL, timeout=5)
        except httpx.HTTPError:
            return []
        return reply.json()["workers"] if reply.status_code == 200 else []

    def status(self, proc: Proc) -> dict:
        return httpx.get(f"{proc.url}/internal/status", headers=INTERNAL, timeout=10).json()

    def live(self, role: str | None = None) -> list[Proc]:
        """Registered workers running (a restarted one once it is back; static ones are the tests' own)."""
        return [p for p in self.workers.values()
                if p.alive() and p.registered and p.child.restarted_at is None and (role is None or p.role == role)]

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, dict]:
        """Every live worker holds no request and every KV block is free again; returns their status."""
        def idle() -> dict[str, dict] | None:
            statuses = {p.name: self.status(p) for p in self.live()}
            done = all(s["free_blocks"] == s["total_blocks"] and s["queue_len"] == 0 and s["num_running"] == 0
                       for s in statuses.values())
            return statuses if done else None

        return wait_until(idle, timeout_s, "every pool back to its initial free count", poll_s=0.2)

    def retire(self, proc: Proc) -> None:
        """SIGKILL. A child of the launcher comes back by itself (`wait_deployment`); an extra is gone for good
        (its log is kept in `retired` for failures)."""
        proc.kill()
        if self.extras.pop(proc.name, None) is not None:
            self.retired.append(proc)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin{path}", headers=ADMIN, timeout=30, **kwargs)

    def stop(self) -> None:
        for proc in self.extras.values():
            proc.kill()
        if self.launcher is not None:
            for child in self.launcher.children:  # thaw what a test froze: SIGTERM must reach a live process
                if child.process.poll() is None:
                    os.kill(child.process.pid, signal.SIGCONT)
            self.launcher.request_stop()
            if self._supervisor is not None:
                self._supervisor.join(timeout=10)
            self.launcher.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
