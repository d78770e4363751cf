"""End-to-end fixtures: real `pdserve serve` processes on loopback, the official `openai` client.

The model is loaded as few times as possible: one disaggregated deployment (router + 1 P + 1 D) and one
`--colocated` deployment for this folder's tests, both started at once on first use (their loads overlap), and
one offline engine (pdserve.llm.LLM) in the test process for reference outputs. They are package-scoped: torn
down once the folder's last test is done, not kept (3 GB, two cores' heartbeats) through the rest of the run.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.deployments import MODEL, Deployment, launch

SHUTDOWN_TEST = "test_shutdown.py"


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def disaggregated(launched: dict[str, Deployment]) -> Deployment:
    return launched["disaggregated"].wait_ready()


@pytest.fixture(scope="package")
def colocated(launched: dict[str, Deployment]) -> Deployment:
    return launched["colocated"].wait_ready()


@pytest.fixture(scope="package", params=["disaggregated", "colocated"])
def deployment(request: pytest.FixtureRequest, launched: dict[str, Deployment]) -> Deployment:
    return launched[request.param].wait_ready()


@pytest.fixture(scope="package")
def offline_llm(launched: dict[str, Deployment], model_cache_dir: Path):
    """The offline engine, loaded while the deployments start (fp32 on CPU like them)."""
    from pdserve.llm import LLM

    return LLM(MODEL, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=1024, cache_dir=model_cache_dir,
               progress=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shutdown test stops the folder's shared deployments, so it runs after every other e2e test (and
    before any test of another folder: they are package-scoped, torn down once this folder is done)."""
    slots = [i for i, item in enumerate(items) if "e2e" in item.path.parts]
    ordered = sorted((items[i] for i in slots), key=lambda item: item.path.name == SHUTDOWN_TEST)
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item
