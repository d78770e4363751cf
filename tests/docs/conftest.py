"""A live `pdserve serve` on the default model for the doc tests: started once per module that asks for it, on
a free port, with an admin token so the operations guide's admin calls can run.

`docs_server_process` only starts it (tests that need no server run meanwhile); `docs_server_url` waits until
the router's /health says a prefill and a decode worker are up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup, http_ok, serve_command
from tests.docs.markdown_blocks import REPO

ADMIN_TOKEN = "docs-test-admin-token"
READY_TIMEOUT_S = 240.0  # as tests/e2e: a loaded 2-core machine boots three processes slowly
# 256 blocks = 4,096 tokens of KV per worker; one torch thread each: the machine may have 2 cores
SERVE_FLAGS = ["--num-blocks", "256", "--torch-threads", "1"]


@dataclass
class DocsServer:
    group: ProcessGroup
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.group.log_path

    def log(self) -> str:
        return self.group.log(3000)

    def wait_ready(self) -> str:
        self.group.wait_until(lambda: http_ok(f"{self.url}/health"), READY_TIMEOUT_S, "pdserve serve")
        return self.url


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
    group = ProcessGroup(serve_command(port, SERVE_FLAGS), log_path, docs_env(model_cache_dir), cwd=REPO).start()
    yield DocsServer(group, port)
    group.stop(grace_s=20)


@pytest.fixture(scope="module")
def docs_server_url(docs_server_process: DocsServer) -> str:
    return docs_server_process.wait_ready()
