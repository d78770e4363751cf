"""A Hugging Face hub cache made in a test, in huggingface_hub's own layout (no hub is reachable from CI):

    <cache>/models--<org>--<name>/blobs/<etag>
    <cache>/models--<org>--<name>/snapshots/<commit>/<file>  -> ../../blobs/<etag>
    <cache>/models--<org>--<name>/refs/<branch>               the commit

Blobs are hard links to the source files (the default model's converted fp32 safetensors is 540 MB; a copy
per test would be slow) where the file system allows, else copies. The hub names a blob by its etag (the
sha256 of an LFS file); here the etag is the sha256 of the file's name and size, which is as unique for a test.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "a" * 40


def make_hub_cache(cache: Path, source: Path, repo_id: str = REPO_ID, commit: str = COMMIT,
                   branch: str = "main", skip: tuple[str, ...] = ("pdserve.json",)) -> Path:
    """A snapshot of `repo_id` at `commit` holding `source`'s files (pdserve's conversion note left out: a real
    repo has none); returns the snapshot directory."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = folder / "blobs", folder / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if not file.is_file() or file.name in skip:
            continue
        etag = hashlib.sha256(f"{file.name}:{file.stat().st_size}".encode()).hexdigest()
        blob = blobs / etag
        if not blob.exists():
            try:
                os.link(file, blob)
            except OSError:
                shutil.copyfile(file, blob)
        link = snapshot / file.name
        if not link.exists():
            link.symlink_to(Path("..") / ".." / "blobs" / etag)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / branch).write_text(commit)
    return snapshot
