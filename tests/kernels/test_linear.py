from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.kernels.linear import linear_ref
from pdserve.kernels.tuning import TuningTable, batch_bucket


@pytest.mark.parametrize(
    "m,n,k,use_dot",
    [(1, 64, 256, True), (3, 48, 100, True), (8, 100, 64, True), (16, 16, 512, True), (1, 64, 256, False),
     (3, 48, 100, False)],
    ids=lambda v: {True: "dot", False: "fma"}.get(v, v) if isinstance(v, bool) else str(v),
)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_matches_ref(
    m: int, n: int, k: int, use_dot: bool, split_k: int, dtype: torch.dtype, randn: Callable, check: Callable
) -> None:
    from pdserve.kernels.linear_triton import GemvConfig, gemv_triton

    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / k**0.5, randn(n, dtype=dtype)
    cfg = GemvConfig(block_n=16, block_k=32, split_k=split_k, use_dot=use_dot, num_warps=4, num_stages=2)
    check(gemv_triton(x, w, bias, cfg), linear_ref(x, w, bias), dtype)
    check(gemv_triton(x, w, None, cfg), linear_ref(x, w), dtype)


@pytest.mark.parametrize("shape", [(1, 256), (2, 3, 256), (5, 256), (40, 256)])
def test_linear_dispatcher_matches_ref(shape: tuple, dtype: torch.dtype, randn: Callable, check: Callable) -> None:
    """Heuristic configs (and the torch path above 16 rows), leading dims kept."""
    from pdserve.kernels.linear_triton import linear_triton

    x, w = randn(*shape, dtype=dtype), randn(96, 256, dtype=dtype) / 16
    out = linear_triton(x, w)
    assert out.shape == (*shape[:-1], 96)
    check(out, linear_ref(x, w), dtype)


def test_tuning_table_round_trip_and_buckets(tmp_path: Path) -> None:
    table = TuningTable()
    table.record("NVIDIA H200", torch.bfloat16, 4096, 14336, 3, {"backend": "torch"})
    path = tmp_path / "t.json"
    table.save(path)
    loaded = TuningTable.load(path)
    assert loaded.lookup("NVIDIA H200", torch.bfloat16, 4096, 14336, 4) == {"backend": "torch"}
    assert loaded.lookup("NVIDIA H200", torch.bfloat16, 4096, 14336, 5) is None
    assert json.loads(path.read_text())["version"] == 1
    assert [batch_bucket(m) for m in (1, 2, 3, 9, 16)] == [1, 2, 4, 16, 16]
    with pytest.raises(ValueError, match="17"):
        batch_bucket(17)


def test_shipped_table_configs_are_valid() -> None:
    from pdserve.kernels.linear_triton import GemvConfig
    from pdserve.kernels.tuning import DEFAULT_PATH

    for key, entry in TuningTable.load(DEFAULT_PATH).entries.items():
        assert entry["backend"] in ("torch", "triton"), key
        if entry["backend"] == "triton":
            GemvConfig(**entry["config"])
