from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.activation import silu_and_mul_ref


@pytest.mark.parametrize("rows,inter", [(1, 64), (3, 100), (17, 1024), (2, 1500)])
def test_silu_and_mul_matches_ref(rows: int, inter: int, dtype: torch.dtype, randn: Callable, check: Callable) -> None:
    from pdserve.kernels.activation_triton import silu_and_mul_triton

    x = randn(rows, 2 * inter, dtype=dtype) * 3
    check(silu_and_mul_triton(x), silu_and_mul_ref(x), dtype)


def test_silu_and_mul_keeps_leading_dims(randn: Callable, check: Callable) -> None:
    from pdserve.kernels.activation_triton import silu_and_mul_triton

    x = randn(2, 3, 2 * 40)
    out = silu_and_mul_triton(x)
    assert out.shape == (2, 3, 40)
    check(out, silu_and_mul_ref(x), torch.float32)


def test_silu_and_mul_rejects_odd_width(randn: Callable) -> None:
    from pdserve.kernels.activation_triton import silu_and_mul_triton

    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(randn(2, 7))
