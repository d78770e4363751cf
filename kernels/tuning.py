"""Tuned kernel configs, measured on a device and kept as JSON beside the kernels.

linear_configs.json maps "device|dtype|N|K|batch bucket" to either {"backend": "torch"} (cuBLAS won) or
{"backend": "triton", "config": {...GemvConfig fields...}}, plus the two times it was chosen on. It is written
by `python benchmarks/kernels.py --tune-linear` on the device it describes; a lookup that misses (another
device or shape) falls back to the launcher's heuristic. prefill_attention_configs.json (absent until measured)
maps "device|dtype|Hq|Hkv|D" to where torch SDPA beats our prefill attention (kernels/prefill_attention.py),
as `python benchmarks/prefill_attention_sdpa.py` proposes it from its measurements; a miss keeps ours. A table elsewhere (a user cache) can be loaded by
path and passed around explicitly; nothing here reads the environment.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

DEFAULT_PATH = Path(__file__).with_name("linear_configs.json")
PREFILL_PATH = Path(__file__).with_name("prefill_attention_configs.json")
BATCH_BUCKETS = (1, 2, 4, 8, 16)


@functools.cache
def device_name(device: torch.device) -> str:
    """The tables' name for the device ("cpu" off CUDA)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def batch_bucket(m: int) -> int:
    """The smallest bucket >= m (configs are tuned at 1, 2, 4, 8, 16 rows)."""
    for bucket in BATCH_BUCKETS:
        if m <= bucket:
            return bucket
    raise ValueError(f"batch {m} is above the largest tuned bucket {BATCH_BUCKETS[-1]}")


def table_key(device_name: str, dtype: torch.dtype, n: int, k: int, m: int) -> str:
    return f"{device_name}|{str(dtype).removeprefix('torch.')}|{n}|{k}|{batch_bucket(m)}"


def prefill_key(device_name: str, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> str:
    return f"{device_name}|{str(dtype).removeprefix('torch.')}|{q_heads}|{kv_heads}|{head_dim}"


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


@functools.cache
def default_prefill_table() -> TuningTable:
    """The prefill attention table shipped beside the kernels (read once per process; empty if absent)."""
    return TuningTable.load(PREFILL_PATH)
