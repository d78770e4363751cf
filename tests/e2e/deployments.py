"""Real `pdserve serve` deployments for the end-to-end tests: start one, wait for it, ask its workers' status.

Every deployment's launcher runs in its own session (process group), so teardown can always kill whatever is
left.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup, serve_command

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 240.0
# 512 blocks = 8,192 tokens of KV per worker, 377 MB in fp32 (46 KB per token for SmolLM2-135M): 1.1 GB for the
# session's three workers, and room for the 32 concurrent requests (~360 blocks). One torch thread per worker:
# five model processes share the 2 cores of the CI machine (see pdserve/launch_plan.py).
WORKER_FLAGS = ["--num-blocks", "512", "--max-num-seqs", "48", "--max-num-batched-tokens", "1024",
                "--torch-threads", "1"]
# The internal API's shared secret: `pdserve serve` would generate one; the tests give theirs, to call /internal/*.
SECRET = "e2e-internal-secret"
INTERNAL = {"X-PDServe-Secret": SECRET}


@dataclass
class Deployment:
    """One `pdserve serve` launcher and what it started."""

    name: str
    group: ProcessGroup
    port: int
    ready: bool = False
    workers: list[dict] = field(default_factory=list)

    @property
    def process(self) -> subprocess.Popen:
        assert self.group.popen is not None
        return self.group.popen

    @property
    def log_path(self) -> Path:
        return self.group.log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.group.log()

    def wait_ready(self) -> Deployment:
        if not self.ready:
            self.group.wait_until(lambda: "pdserve ready" in self.group.log(tail=1 << 30), READY_TIMEOUT_S, self.name)
            self.ready = True
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
        """Every process whose parent is the launcher."""
        return self.group.children()

    def kill_everything(self) -> None:
        self.group.kill()


def launch(name: str, extra: list[str], tmp: Path, cache_dir: Path, env: dict[str, str] | None = None) -> Deployment:
    """`env`: extra environment of the launcher and its children (e.g. PDSERVE_ADMIN_TOKEN for the router)."""
    port = free_port()
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache_dir), "PDSERVE_SECRET": SECRET, **(env or {})}
    group = ProcessGroup(serve_command(port, [*WORKER_FLAGS, *extra]), tmp / f"{name}.log", env, cwd=REPO)
    return Deployment(name, group.start(), port)
