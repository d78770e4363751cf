"""End-to-end fixtures: real `pdserve serve` processes on loopback, the official `openai` client.

The model is loaded as few times as possible: one disaggregated deployment (router + 1 P + 1 D) and one
`--colocated` deployment per test session, both started at once on first use (their loads overlap), and one
offline engine (pdserve.llm.LLM) in the test process for reference outputs. Every deployment's launcher runs
in its own session (process group), so teardown can always kill whatever is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 240.0
# Small pools keep the three KV pools of this session under 1 GB (fp32: 46 KB per token for SmolLM2-135M).
WORKER_FLAGS = ["--num-blocks", "768", "--max-num-seqs", "48", "--max-num-batched-tokens", "1024", "--torch-threads", "1"]
SHUTDOWN_TEST = "test_shutdown.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        self.workers = httpx.get(f"{self.url}/internal/workers", timeout=5).json()["workers"]
        return self

    def worker_url(self, role: str) -> str:
        [worker] = [w for w in self.workers if role in w["roles"]]
        return worker["url"]

    def status(self, role: str) -> dict:
        return httpx.get(f"{self.worker_url(role)}/internal/status", timeout=5).json()

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


def launch(name: str, extra: list[str], tmp: Path, cache_dir: Path) -> Deployment:
    port = free_port()
    log_path = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *WORKER_FLAGS, *extra]
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache_dir)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
    return Deployment(name, process, port, log_path)


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
             default_model_dir: Path) -> Iterator[dict[str, Deployment]]:
    """Both deployments, started together; `default_model_dir` makes sure the model is fetched first."""
    tmp = tmp_path_factory.mktemp("e2e")
    deployments = {"disaggregated": launch("disaggregated", [], tmp, model_cache_dir),
                   "colocated": launch("colocated", ["--colocated"], tmp, model_cache_dir)}
    yield deployments
    for deployment in deployments.values():
        if deployment.process.poll() is None:
            deployment.process.send_signal(signal.SIGTERM)
    for deployment in deployments.values():
        try:
            deployment.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        deployment.kill_everything()


@pytest.fixture(scope="session")
def disaggregated(launched: dict[str, Deployment]) -> Deployment:
    return launched["disaggregated"].wait_ready()


@pytest.fixture(scope="session")
def colocated(launched: dict[str, Deployment]) -> Deployment:
    return launched["colocated"].wait_ready()


@pytest.fixture(scope="session", params=["disaggregated", "colocated"])
def deployment(request: pytest.FixtureRequest, launched: dict[str, Deployment]) -> Deployment:
    return launched[request.param].wait_ready()


@pytest.fixture(scope="session")
def offline_llm(launched: dict[str, Deployment], model_cache_dir: Path):
    """The offline engine, loaded while the deployments start (fp32 on CPU like them)."""
    from pdserve.llm import LLM

    return LLM(MODEL, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=1024, cache_dir=model_cache_dir,
               progress=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shutdown test stops the session's deployments, so it runs after every other e2e test."""
    items.sort(key=lambda item: item.path.name == SHUTDOWN_TEST)
