"""Reliability tests on real processes: one deployment for the session, started as `pdserve serve --num-prefill 2
--num-decode 2` starts it (its launcher, each process under the pickle guard), whose supervision restarts
what a test kills (`healthy` waits for that); a static decode worker beside it; an offline reference engine in
the test process. Modules run in MODULE_ORDER: the security module last, since it checks the pickle
log of everything that ran before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.cluster import MAX_INFLIGHT, MODEL, WORKER_FLAGS, Cluster

MODULE_ORDER = ("test_hostile_input.py", "test_kv_failures.py", "test_worker_failures.py", "test_redis_outage.py",
                "test_overload.py", "test_soak.py", "test_security.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder this folder's tests among themselves (others keep their places)."""
    slots = [i for i, item in enumerate(items) if item.path.name in MODULE_ORDER and "reliability" in item.path.parts]
    ordered = sorted((items[i] for i in slots), key=lambda item: MODULE_ORDER.index(item.path.name))
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
            default_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("reliability")
    cluster = Cluster(tmp, model_cache_dir, tmp / "pickle_guard.log")
    try:
        # every prompt through a prefill worker while one can take it: these tests break P, D and the P -> D
        # path; a prompt whose short suffix D could prefill itself (conditional disaggregation, docs/kv_cache.md)
        # would skip P. A short fresh prompt still goes to D when every P is busy (--busy-prefill-backlog: one
        # forward of these workers, whose --max-num-batched-tokens is 512): the prefill-kill test's new requests
        cluster.launch("--max-inflight-requests", str(MAX_INFLIGHT), "--local-prefill-threshold", "0",
                       "--busy-prefill-backlog", "512")
        fail_d = cluster.start_worker("decode", "decode-fail", *WORKER_FLAGS, "--kv-lease-timeout", "1",
                                      "--kv-load-failure-policy", "fail", register=False)
        cluster.supervise()
        cluster.wait_ready(fail_d)
        yield cluster
    finally:
        cluster.stop()


def heal(cluster: Cluster) -> None:
    """Every process of the deployment running and registered (the launcher restarted what a test killed), idle."""
    cluster.wait_deployment()
    cluster.wait_idle()


@pytest.fixture
def healthy(cluster: Cluster) -> Cluster:
    heal(cluster)
    return cluster


@pytest.fixture(scope="package")
def reference_llm(model_cache_dir: Path):
    """The offline engine (fp32 on CPU like the workers) for greedy reference outputs."""
    from pdserve.llm import LLM

    return LLM(MODEL, num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048, cache_dir=model_cache_dir,
               progress=False)
