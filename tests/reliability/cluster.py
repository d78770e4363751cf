"""A router and workers as separate `pdserve` processes on loopback, started one by one so that a test can
kill (SIGKILL), freeze (SIGSTOP) and replace any of them, and read their memory.

Every process gets the internal API's shared secret and the router's API key by environment (as `pdserve serve`
hands them out), and runs under the pickle guard (tests/reliability/pickle_guard): a pickle call in any of
them is logged and refused, so the session's last test can prove none happened.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

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
READY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    name: str
    role: str  # router | prefill | decode
    process: subprocess.Popen
    port: int
    log_path: Path
    transfer_port: int | None = None
    registered: bool = True  # registers with the router (else static: nobody routes to it)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def signal(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

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
    router: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)
    retired: list[Proc] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(GUARD_DIR), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PDSERVE_CACHE_DIR": str(self.cache_dir), "PDSERVE_SECRET": SECRET,
                "PDSERVE_API_KEY": API_KEY, "PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONPATH": path,
                "PDSERVE_TEST_PICKLE_GUARD_LOG": str(self.pickle_log)}

    def _spawn(self, name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        log_path = self.tmp / f"{name}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], cwd=REPO, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True, env=self.env())
        return process, log_path

    # ---- starting -------------------------------------------------------------------------------------

    def start_router(self, *extra: str) -> Proc:
        self.router = self.spawn_router("router", *extra)
        return self.router

    def spawn_router(self, name: str, *extra: str) -> Proc:
        """A router process; only `start_router`'s is the cluster's (others are the caller's to stop)."""
        port = free_port()
        # heartbeats every 0.5 s, a worker silent for 4 s is dropped: a dead one is noticed sooner anyway (its
        # stream breaks, its port refuses), and five model processes on two cores can stall a loop for seconds
        process, log = self._spawn(name, ["router", "--port", str(port), "--heartbeat-interval", "0.5",
                                          "--heartbeat-timeout", "4", *extra])
        return Proc(name, "router", process, port, log)

    def start_worker(self, role: str, name: str, *extra: str, register: bool = True) -> Proc:
        port, transfer = free_port(), free_port()
        argv = [role, "--port", str(port), "--worker-id", name, "--transfer-port", str(transfer), *extra]
        if register:
            assert self.router is not None
            argv += ["--router", self.router.url]
        process, log = self._spawn(name, argv)
        proc = Proc(name, role, process, port, log, transfer, registered=register)
        self.workers[name] = proc
        return proc

    def wait_ready(self, *procs: Proc, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Each answers /health (workers: registered), the router lists the registered ones."""
        def ready() -> bool:
            for proc in procs:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log()}")
            if not all(_healthy(f"{p.url}/health" if p.role != "router" else f"{p.url}/metrics") for p in procs):
                return False
            names = {w["worker_id"] for w in self.registry()} if self.router is not None else set()
            return all(p.name in names for p in procs if p.role != "router" and p.registered)

        wait_until(ready, timeout_s, f"{[p.name for p in procs]} ready", poll_s=0.25)

    # ---- talking to it --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.router is not None
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
        """Registered workers still running (static ones are the tests' own)."""
        return [p for p in self.workers.values() if p.alive() and p.registered and (role is None or p.role == role)]

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, dict]:
        """Every live worker holds no request and every KV block is free again; returns their status."""
        def idle() -> dict[str, dict] | None:
            statuses = {p.name: self.status(p) for p in self.live()}
            done = all(s["free_blocks"] == s["total_blocks"] and s["queue_len"] == 0 and s["num_running"] == 0
                       for s in statuses.values())
            return statuses if done else None

        return wait_until(idle, timeout_s, "every pool back to its initial free count", poll_s=0.2)

    def retire(self, proc: Proc) -> None:
        """SIGKILL; the process stays listed in `retired` (its log is kept for failures)."""
        proc.kill()
        self.workers.pop(proc.name, None)
        self.retired.append(proc)

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}/admin{path}", headers=ADMIN, timeout=30, **kwargs)

    def stop(self) -> None:
        for proc in [*self.workers.values(), *([self.router] if self.router else [])]:
            try:
                proc.signal(signal.SIGCONT)
                proc.signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.process.wait(timeout=10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
