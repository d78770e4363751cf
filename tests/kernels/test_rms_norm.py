from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref


@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 100), (17, 256), (5, 4096)])
def test_rms_norm_matches_ref(rows: int, hidden: int, dtype: torch.dtype, randn: Callable, check: Callable) -> None:
    from pdserve.kernels.rms_norm_triton import rms_norm_triton

    x, w = randn(rows, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    check(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 100), (33, 128)])
def test_fused_add_rms_norm_matches_ref(
    rows: int, hidden: int, dtype: torch.dtype, randn: Callable, check: Callable
) -> None:
    from pdserve.kernels.rms_norm_triton import fused_add_rms_norm_triton

    x, res, w = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype), randn(hidden)
    out, h = fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_out, ref_h = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(h, ref_h)
    check(out, ref_out, dtype)


def test_rms_norm_keeps_leading_dims_and_strided_rows(randn: Callable, check: Callable) -> None:
    from pdserve.kernels.rms_norm_triton import rms_norm_triton

    x, w = randn(2, 3, 2 * 48)[..., :48], randn(48)
    out = rms_norm_triton(x, w, 1e-5)
    assert out.shape == (2, 3, 48)
    check(out, rms_norm_ref(x, w, 1e-5), torch.float32)


def test_rms_norm_rejects_wrong_weight(randn: Callable) -> None:
    from pdserve.kernels.rms_norm_triton import rms_norm_triton

    with pytest.raises(ValueError, match="hidden=64"):
        rms_norm_triton(randn(2, 64), randn(32), 1e-5)
