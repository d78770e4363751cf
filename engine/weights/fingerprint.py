"""A stable id for a set of weights, used in KV block hashes (two workers share KV only if ids match).

fingerprint = sha256(name, config, dtype, content digest). The content digest must be cheap on a 140 GB
checkpoint, so it reads each file's size and three 1 MiB samples (start, middle, end) rather than all bytes:
it tells different checkpoints apart; it is not an integrity check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from pdserve.engine.config import ModelConfig

_SAMPLE = 1 << 20


def file_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        for start in sorted({0, max(size // 2 - _SAMPLE // 2, 0), max(size - _SAMPLE, 0)}):
            f.seek(start)
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def files_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        h.update(file_digest(path).encode())
    return h.hexdigest()


def config_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def model_fingerprint(name: str, config: ModelConfig, dtype: str, content_digest: str) -> str:
    """dtype is part of it: KV computed from fp16 and from fp32 weights must not be mixed."""
    payload = json.dumps({"name": name, "config": config_json(config), "dtype": dtype, "content": content_digest},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
