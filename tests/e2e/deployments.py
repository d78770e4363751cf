"""Real `pdserve serve` deployments for the end-to-end tests: start one, wait for it, ask its workers' status.

Every deployment's launcher runs in its own session (process group), so teardown can always kill whatever is
left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 240.0
# 512 blocks = 8,192 tokens of KV per worker, 377 MB in fp32 (46 KB per token for SmolLM2-135M): 1.1 GB for the
# session's three workers, and room for the 32 concurrent requests (~360 blocks). One torch thread per worker:
# five model processes share the 2 cores of the CI machine (see pdserve/launcher.py).
WORKER_FLAGS = ["--num-blocks", "512", "--max-num-seqs", "48", "--max-num-batched-tokens", "1024",
                "--torch-threads", "1"]
# The internal API's shared secret: `pdserve serve` would generate one; the tests give theirs, to call /internal/*.
SECRET = "e2e-internal-secret"
INTERNAL = {"X-PDServe-Secret": SECRET}


@dataclass
class Deployment:
    """One `pdserve serve` launcher and what it started."""

    name: str
    process: subprocess.Popen
    port: int
    log_path: Path
    ready: bool = False
    workers: list[dict] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> Deployment:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {READY_TIMEOUT_S} s:\n{self.log()}")
            self.ready = "pdserve ready" in self.log_path.read_text(errors="replace")
            time.sleep(0.2)
        self.workers = httpx.get(f"{self.url}/internal/workers", headers=INTERNAL, timeout=5).json()["workers"]
        return self

    def worker_url(self, role: str) -> str:
        [worker] = [w for w in self.workers if role in w["roles"]]
        return worker["url"]

    def data_address(self, role: str) -> tuple[str, int]:
        """Where the worker of `role` takes data-plane connections."""
        [worker] = [w for w in self.workers if role in w["roles"]]
        return urlsplit(worker["url"]).hostname or "127.0.0.1", worker["data_port"]

    def status(self, role: str) -> dict:
        return httpx.get(f"{self.worker_url(role)}/internal/status", headers=INTERNAL, timeout=5).json()

    def child_pids(self) -> list[int]:
        """Every process whose parent is the launcher (read from /proc: no psutil needed)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                    pids.append(int(entry.name))
        return pids

    def kill_everything(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


def launch(name: str, extra: list[str], tmp: Path, cache_dir: Path, env: dict[str, str] | None = None) -> Deployment:
    """`env`: extra environment of the launcher and its children (e.g. PDSERVE_ADMIN_TOKEN for the router)."""
    port = free_port()
    log_path = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *WORKER_FLAGS, *extra]
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache_dir), "PDSERVE_SECRET": SECRET, **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
    return Deployment(name, process, port, log_path)


