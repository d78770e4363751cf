"""The KV pool's share of a GPU (--gpu-memory-utilization), computed from numbers passed in (no GPU needed)."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_cache import ACTIVATION_RESERVE_BYTES, gpu_kv_budget

GIB = 1 << 30


def test_share_less_weights_and_reserve() -> None:
    # an H200 (141 GiB) alone: 0.9 x 141 - 16 GiB of Llama-3-8B weights - 2 GiB reserve
    assert gpu_kv_budget(141 * GIB, 124 * GIB, 16 * GIB, 0.9) == int(141 * GIB * 0.9) - 18 * GIB
    assert ACTIVATION_RESERVE_BYTES == 2 * GIB


def test_p_and_d_on_one_gpu_each_take_their_share() -> None:
    # P started first and holds its 0.4 share; D sees only what is free, but its share still fits in it
    p_budget = gpu_kv_budget(100 * GIB, 99 * GIB, 16 * GIB, 0.4)
    assert p_budget == 22 * GIB
    assert gpu_kv_budget(100 * GIB, 100 * GIB - 40 * GIB - 16 * GIB, 16 * GIB, 0.4) == 22 * GIB
    # a share larger than what is free is capped by the free memory (less the reserve)
    assert gpu_kv_budget(100 * GIB, 30 * GIB, 16 * GIB, 0.8) == 28 * GIB


def test_nothing_left_names_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"0\.2 x 80\.00 GiB = 16\.00 GiB .* less 15\.00 GiB .* 2\.00 GiB .* -1\.00 GiB"):
        gpu_kv_budget(80 * GIB, 60 * GIB, 15 * GIB, 0.2)
    with pytest.raises(ValueError, match=r"has 1\.50 GiB free of 80\.00 GiB"):
        gpu_kv_budget(80 * GIB, int(1.5 * GIB), 15 * GIB, 0.9)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        gpu_kv_budget(80 * GIB, 80 * GIB, 0, 1.5)
