"""Split-K partials left for the next kernel to sum (kernels/split_sum.py): the residual norms sum them exactly as
the split-K reduce kernel would have (bit for bit, on the interpreter and on the GPU), and the linears return them
only where a Triton product split along K without a bias."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.fp8_weight import quantize_rows_fp8_ref, quantize_weight_fp8
from pdserve.kernels.rms_norm import fused_add_rms_norm_fp8_ref, fused_add_rms_norm_ref
from pdserve.kernels.split_sum import SplitSum, summed


def _reduced(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The split-K reduce kernel's output for these partials."""
    from pdserve.kernels.linear_triton import reduce_split_k

    out = torch.empty(part.shape[1:], dtype=dtype, device=part.device)
    reduce_split_k(part, None, out)
    return out


@pytest.mark.parametrize("splits,rows,hidden", [(2, 1, 64), (3, 5, 100), (4, 17, 256), (2, 33, 128)])
def test_norm_sums_partials_as_the_reduce_kernel_would(splits: int, rows: int, hidden: int, dtype: torch.dtype,
                                                       randn: Callable) -> None:
    """Plain and fp8 forms: the same normalised row (codes and scales), the same h, bit for bit, as the reduce
    kernel followed by the norm; the references agree with SplitSum.summed, which is the reduce kernel's sum."""
    from pdserve.kernels.rms_norm_triton import fused_add_rms_norm_fp8_triton, fused_add_rms_norm_triton

    part = randn(splits, rows, hidden) * 2
    res, w = randn(rows, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    split = SplitSum(part, dtype)
    x = _reduced(part, dtype)
    assert torch.equal(split.summed(), x)
    for norm in (fused_add_rms_norm_triton, fused_add_rms_norm_ref):
        out, h = norm(split, res, w, 1e-6)
        want_out, want_h = norm(x, res, w, 1e-6)
        assert torch.equal(h, want_h) and torch.equal(out, want_out)
    for norm in (fused_add_rms_norm_fp8_triton, fused_add_rms_norm_fp8_ref):
        act, h = norm(split, res, w, 1e-6)
        want, want_h = norm(x, res, w, 1e-6)
        assert torch.equal(h, want_h) and torch.equal(act.scale, want.scale)
        assert torch.equal(act.q.view(torch.uint8), want.q.view(torch.uint8)) and act.dtype == dtype


def test_norm_takes_partials_only_with_a_residual_of_their_dtype(randn: Callable) -> None:
    from pdserve.kernels.rms_norm_triton import _launch

    split, w = SplitSum(randn(2, 3, 64), torch.float32), randn(64)
    with pytest.raises(ValueError, match="fused form only"):
        _launch(split, None, w, 1e-6)
    with pytest.raises(ValueError, match="fused form only"):
        _launch(split, randn(3, 64, dtype=torch.float16), w, 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        _launch(split, randn(4, 64), w, 1e-6)


def test_split_sum_checks_its_partials_and_selects_rows(randn: Callable) -> None:
    with pytest.raises(ValueError, match="fp32"):
        SplitSum(randn(2, 3, 8, dtype=torch.float16), torch.float16)
    with pytest.raises(ValueError, match=r"\[S, M, N\]"):
        SplitSum(randn(3, 8), torch.float32)
    part = randn(3, 5, 8)
    split = SplitSum(part, torch.float16)
    assert split.shape == (5, 8) and split.device == part.device
    rows = torch.tensor([4, 1], device=part.device)
    assert torch.equal(split[rows].summed(), split.summed()[rows])
    assert torch.equal(summed(split), split.summed()) and summed(part) is part


@pytest.mark.parametrize("split_k,bias,want_split", [(2, False, True), (2, True, False), (1, False, False)])
def test_linears_leave_the_sum_only_where_they_split_without_bias(split_k: int, bias: bool, want_split: bool,
                                                                   dtype: torch.dtype, randn: Callable) -> None:
    """The fp8 skinny product and the GEMV: unsummed gives a SplitSum exactly where the product split along K
    and has no bias, and its sum is the summed call's output, bit for bit."""
    from pdserve.kernels.linear_fp8_skinny_triton import Fp8SkinnyConfig, fp8_skinny_triton
    from pdserve.kernels.linear_triton import GemvConfig, gemv_triton

    m, n, k = 3, 64, 256
    b = randn(n, dtype=dtype) if bias else None
    x = randn(m, k, dtype=dtype)
    xq, sx = quantize_rows_fp8_ref(x)
    w8 = quantize_weight_fp8(randn(n, k) / k**0.5)
    cfg8 = Fp8SkinnyConfig(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    w = randn(n, k, dtype=dtype) / k**0.5
    cfg = GemvConfig(block_n=32, block_k=64, split_k=split_k, use_dot=dtype != torch.float32)
    for run in (lambda unsummed: fp8_skinny_triton(xq, sx, w8, b, dtype, cfg8, unsummed),
                lambda unsummed: gemv_triton(x, w, b, cfg, unsummed=unsummed)):
        out, left = run(False), run(True)
        assert isinstance(left, SplitSum) == want_split and not isinstance(out, SplitSum)
        assert torch.equal(summed(left), out) and summed(left).dtype == dtype
