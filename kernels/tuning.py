"""Tuned kernel configs, measured on a device and kept as JSON beside the kernels.

linear_configs.json maps "device|dtype|N|K|batch bucket" to either {"backend": "torch"} (cuBLAS won) or
{"backend": "triton", "config": {...GemvConfig fields...}}, plus the two times it was chosen on. It is written
by `python benchmarks/kernels.py --tune-linear` on the device it describes; a lookup that misses (another
device or shape) falls back to the launcher's heuristic. A table elsewhere (a user cache) can be loaded by
path and passed around explicitly; nothing here reads the environment.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

DEFAULT_PATH = Path(__file__).with_name("linear_configs.json")
BATCH_BUCKETS = (1, 2, 4, 8, 16)


def batch_bucket(m: int) -> int:
    """The smallest bucket >= m (configs are tuned at 1, 2, 4, 8, 16 rows)."""
    for bucket in BATCH_BUCKETS:
        if m <= bucket:
            return bucket
    raise ValueError(f"batch {m} is above the largest tuned bucket {BATCH_BUCKETS[-1]}")


def table_key(device_name: str, dtype: torch.dtype, n: int, k: int, m: int) -> str:
    return f"{device_name}|{str(dtype).removeprefix('torch.')}|{n}|{k}|{batch_bucket(m)}"


class TuningTable:
    def __init__(self, entries: dict[str, dict[str, Any]] | None = None) -> None:
        self.entries: dict[str, dict[str, Any]] = dict(entries or {})

    @classmethod
    def load(cls, path: Path) -> TuningTable:
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        if data.get("version") != 1:
            raise ValueError(f"{path}: unknown tuning table version {data.get('version')!r}")
        return cls(data["entries"])

    def save(self, path: Path) -> None:
        body = {"version": 1, "entries": dict(sorted(self.entries.items()))}
        path.write_text(json.dumps(body, indent=1) + "\n")

    def lookup(self, device_name: str, dtype: torch.dtype, n: int, k: int, m: int) -> dict[str, Any] | None:
        return self.entries.get(table_key(device_name, dtype, n, k, m))

    def record(self, device_name: str, dtype: torch.dtype, n: int, k: int, m: int, entry: dict[str, Any]) -> None:
        self.entries[table_key(device_name, dtype, n, k, m)] = entry


@functools.cache
def default_table() -> TuningTable:
    """The table shipped beside the kernels (read once per process)."""
    return TuningTable.load(DEFAULT_PATH)
