"""A live `pdserve serve` on the default model for the doc tests: started once per module that asks for it, on
a free port, with an admin token so the operations guide's admin calls can run.

`docs_server_process` only starts it (tests that need no server run meanwhile); `docs_server_url` waits until
the router's /health says a prefill and a decode worker are up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import free_port
from tests.docs.markdown_blocks import REPO

ADMIN_TOKEN = "docs-test-admin-token"
READY_TIMEOUT_S = 240.0  # as tests/e2e: a loaded 2-core machine boots three processes slowly
# 256 blocks = 4,096 tokens of KV per worker; one torch thread each: the machine may have 2 cores
SERVE_FLAGS = ["--num-blocks", "256", "--torch-threads", "1"]


@dataclass
class DocsServer:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve serve not ready after {READY_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.2)


def docs_env(cache_dir: Path) -> dict[str, str]:
    """What a reader's shell would hold: the admin token they exported, the model cache."""
    return {**os.environ, "PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN, "PDSERVE_CACHE_DIR": str(cache_dir),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def docs_server_process(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
                        default_model_dir: Path) -> Iterator[DocsServer]:
    """`default_model_dir` makes sure the model is fetched before three processes load it."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("docs") / "serve.log"
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *SERVE_FLAGS]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=docs_env(model_cache_dir))
    server = DocsServer(process, port, log_path)
    yield server
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: whatever is left of router and workers
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def docs_server_url(docs_server_process: DocsServer) -> str:
    return docs_server_process.wait_ready()
