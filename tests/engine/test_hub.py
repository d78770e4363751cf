"""Hugging Face repo ids: found in a hub cache made here in huggingface_hub's layout, loaded offline; a repo
that is not there fails with a message naming the repo, the revision and the directory looked in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.weights import ModelSpec, load_model, load_tokenizer, resolve_model
from pdserve.engine.weights.hub import (
    HubOptions,
    ModelNotFoundError,
    cached_snapshot,
    looks_like_repo_id,
    snapshot_dir,
)
from pdserve.engine.weights.registry import ModelKind
from tests.engine.hub_cache import COMMIT, REPO_ID, make_hub_cache


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    make_hub_cache(cache, default_model_dir)
    make_hub_cache(cache, default_model_dir, commit="b" * 40, branch="v2")
    return cache


def test_repo_ids_are_told_from_paths_and_names() -> None:
    assert looks_like_repo_id(REPO_ID) and looks_like_repo_id("org/model.v1")
    for text in ("smollm2-135m-instruct", "./org/name", "/abs/path", "a/b/c", "org/file.gguf", "~/models/x", "org/"):
        assert not looks_like_repo_id(text), text
    resolved = resolve_model(REPO_ID)
    assert resolved.kind is ModelKind.HUB and resolved.name == REPO_ID


def test_snapshot_found_by_branch_and_by_commit(hub_cache: Path) -> None:
    main = cached_snapshot(REPO_ID, HubOptions(cache_dir=str(hub_cache)))
    assert main == hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert cached_snapshot(REPO_ID, HubOptions(revision="v2", cache_dir=str(hub_cache))).name == "b" * 40
    assert cached_snapshot(REPO_ID, HubOptions(revision="c" * 40, cache_dir=str(hub_cache))) is None
    assert cached_snapshot(REPO_ID, HubOptions(revision="nope", cache_dir=str(hub_cache))) is None


def test_the_layout_is_huggingface_hubs_own(hub_cache: Path) -> None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(REPO_ID, "config.json", cache_dir=str(hub_cache))
    assert Path(str(found)).parent == cached_snapshot(REPO_ID, HubOptions(cache_dir=str(hub_cache)))


def test_a_repo_id_loads_from_the_cache_under_its_own_name(hub_cache: Path, loaded_default, tmp_path: Path) -> None:
    spec = ModelSpec(REPO_ID, hub=HubOptions(cache_dir=str(hub_cache), allow_download=False))
    loaded = load_model(spec, dtype=torch.float32, device="cpu", cache_dir=tmp_path)
    assert loaded.config.name == REPO_ID
    assert loaded.path == cached_snapshot(REPO_ID, HubOptions(cache_dir=str(hub_cache)))
    assert torch.equal(loaded.weights["model.norm.weight"], loaded_default.weights["model.norm.weight"])
    tokenizer = load_tokenizer(spec, tmp_path)
    assert tokenizer is not None and tokenizer.encode("Hello") == loaded_default.tokenizer.encode("Hello")


def test_a_missing_repo_says_what_was_looked_for_and_where(tmp_path: Path) -> None:
    options = HubOptions(revision="v9", cache_dir=str(tmp_path), allow_download=False)
    with pytest.raises(ModelNotFoundError) as err:
        snapshot_dir("org/absent", options)
    message = str(err.value)
    for part in ("'org/absent'", "revision v9", str(tmp_path), "models--org--absent", "downloads are off"):
        assert part in message, message


def test_a_failed_download_names_the_hub_and_the_cause(tmp_path: Path) -> None:
    """A real `pdserve model fetch` whose hub is a closed port: the download fails at once, with a clear exit."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    env.pop("HF_HUB_OFFLINE", None)
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "model", "fetch", "org/absent"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    for part in ("'org/absent' (revision main)", str(tmp_path / "hf" / "hub"), "http://127.0.0.1:9 failed",
                 "pdserve model fetch REPO_ID"):
        assert part in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_offline_mode_forbids_the_download(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "model", "fetch", "org/absent"], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "HF_HUB_OFFLINE is set" in out.stderr, out.stderr
