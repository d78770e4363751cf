"""The producers that quantize their output for an fp8 linear (rms_norm_fp8, fused_add_rms_norm_fp8,
silu_and_mul_fp8) against the composition they replace, and linear() fed their Fp8Activation.

On CPU (the interpreter, fp32 / fp16) the codes and scales are compared bit for bit with quantize_rows_fp8_ref
of the unfused kernel's output, and with the references' composition (norm_ref -> quantize_rows_fp8_ref) where
the unfused kernel itself equals its reference bit for bit: fp16 outputs (rounded to fp16, the fp32 math's
last-bit differences vanish for these shapes). At fp32 the unfused kernels differ from torch in the last bit
(the norm's rsqrt and sum order, silu's exp), and so may the scales of the references' composition. On CUDA (bf16 added): against the unfused
Triton kernels (what the engine's unfused path runs) up to the GPU's last-bit differences (assert_same_codes),
and within e4m3's rounding of the references.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels import linear
from pdserve.kernels.activation import silu_and_mul_fp8_ref, silu_and_mul_ref
from pdserve.kernels.fp8_activation import Fp8Activation, quantize_activation_ref
from pdserve.kernels.fp8_weight import FP8_DTYPE, quantize_weight_fp8
from pdserve.kernels.linear_fp8 import linear_fp8_ref
from pdserve.kernels.rms_norm import (
    fused_add_rms_norm_fp8_ref,
    fused_add_rms_norm_ref,
    rms_norm_fp8_ref,
    rms_norm_ref,
)

CUDA = torch.cuda.is_available()
_REL = 2.0**-4  # e4m3's rounding, relative (test_linear_fp8.py); twice it on CUDA, where the norm's bf16 may differ


def assert_same_codes(out: Fp8Activation, ref: Fp8Activation) -> None:
    """Bit for bit in the interpreter. On CUDA the fused kernel's normalized row may sit a last bit off the
    unfused kernel's (the compiler contracts the multiplies into FMAs differently when the value also feeds the
    amax: the H200, 2026-12-02, fp32 17 x 256, scales 1 ulp apart): there scales agree within 2 ulp, every code of
    a row whose scale agrees is equal, and the others are at most one e4m3 step apart."""
    assert out.q.dtype == ref.q.dtype == FP8_DTYPE and out.dtype == ref.dtype
    assert out.q.shape == ref.q.shape and out.scale.shape == ref.scale.shape
    a, b = out.q.view(torch.uint8), ref.q.view(torch.uint8)
    if not CUDA:
        assert torch.equal(out.scale, ref.scale), (out.scale - ref.scale).abs().max()
        assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} codes differ"
        return
    torch.testing.assert_close(out.scale, ref.scale, rtol=2.5e-7, atol=0)
    agree = out.scale == ref.scale
    assert torch.equal(a[agree], b[agree]), f"{int((a[agree] != b[agree]).sum())} codes differ in rows of equal scale"
    steps = (a.int() - b.int()).abs()
    assert (steps <= 1).all(), f"codes {int(steps.max())} steps apart"


def assert_within_e4m3(out: Fp8Activation, ref: torch.Tensor) -> None:
    """|dequantized - ref| within e4m3's rounding of the row (the GPU's bf16 norm may sit a last bit off)."""
    ref2 = ref.reshape(out.shape).float()
    bound = 2 * _REL * ref2.abs() + 2.0**-9 * out.scale[:, None] + 1e-2 * ref2.abs().amax(-1, keepdim=True) / 448
    assert ((out.dequantize() - ref2).abs() <= bound).all()


def _unfused(x: torch.Tensor) -> Fp8Activation:
    """What the linear's own quantization would make of the unfused kernel's output."""
    if not CUDA:
        return quantize_activation_ref(x)
    from pdserve.kernels.linear_fp8_triton import quantize_rows_fp8_triton

    q, s = quantize_rows_fp8_triton(x.reshape(-1, x.shape[-1]))
    return Fp8Activation(q, s, x.dtype)


SHAPES = [(1, 64), (3, 100), (17, 256), (2, 1000), (5, 4096)]  # (rows, hidden): M = 1, K not a power of two


@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_rms_norm_fp8_matches_the_composition(rows: int, hidden: int, dtype: torch.dtype, randn: Callable) -> None:
    from pdserve.kernels.rms_norm_triton import rms_norm_fp8_triton, rms_norm_triton

    x, w = randn(rows, hidden, dtype=dtype) * 3, randn(hidden, dtype=dtype)
    x[rows // 2] = 0.0  # a row of zeros: the floor scale, zero codes (-0 where the weight is negative)
    out = rms_norm_fp8_triton(x, w, 1e-5)
    assert_same_codes(out, _unfused(rms_norm_triton(x, w, 1e-5)))
    if CUDA:
        assert_within_e4m3(out, rms_norm_ref(x, w, 1e-5))
    elif dtype == torch.float16:
        assert_same_codes(out, rms_norm_fp8_ref(x, w, 1e-5))


@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_fused_add_rms_norm_fp8_matches_the_composition(rows: int, hidden: int, dtype: torch.dtype,
                                                        randn: Callable) -> None:
    """The residual h = x + residual is still written, equal to the reference's."""
    from pdserve.kernels.rms_norm_triton import fused_add_rms_norm_fp8_triton, fused_add_rms_norm_triton

    x, res, w = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    out, h = fused_add_rms_norm_fp8_triton(x, res, w, 1e-6)
    plain, plain_h = fused_add_rms_norm_triton(x, res, w, 1e-6)
    assert torch.equal(h, plain_h) and torch.equal(h, fused_add_rms_norm_ref(x, res, w, 1e-6)[1])
    assert_same_codes(out, _unfused(plain))
    if CUDA:
        assert_within_e4m3(out, fused_add_rms_norm_ref(x, res, w, 1e-6)[0])
    elif dtype == torch.float16:
        assert_same_codes(out, fused_add_rms_norm_fp8_ref(x, res, w, 1e-6)[0])


@pytest.mark.parametrize("rows,inter", [(1, 64), (3, 100), (4, 5000), (2, 20000)])
def test_silu_and_mul_fp8_matches_the_composition(rows: int, inter: int, dtype: torch.dtype,
                                                  randn: Callable) -> None:
    """5,000 wide: the row held whole (8,192 lanes, the tail masked); 20,000: above ONE_PASS_MAX_K, an amax
    pass and a cast pass over 4,096-wide blocks."""
    from pdserve.kernels.activation_triton import silu_and_mul_fp8_triton, silu_and_mul_triton

    x = randn(rows, 2 * inter, dtype=dtype) * 3
    out = silu_and_mul_fp8_triton(x)
    assert_same_codes(out, _unfused(silu_and_mul_triton(x)))
    if CUDA:
        assert_within_e4m3(out, silu_and_mul_ref(x))
    elif dtype == torch.float16:
        assert_same_codes(out, silu_and_mul_fp8_ref(x))


def test_fused_producers_keep_leading_dims_as_rows(randn: Callable) -> None:
    from pdserve.kernels.activation_triton import silu_and_mul_fp8_triton, silu_and_mul_triton

    x = randn(2, 3, 2 * 48)
    out = silu_and_mul_fp8_triton(x)
    assert out.shape == (6, 48)
    assert_same_codes(out, _unfused(silu_and_mul_triton(x.reshape(6, 96))))


@pytest.mark.parametrize("rows", [1, 5, 70])  # the skinny kernel's rows, and the GEMM's (> 64)
def test_linear_takes_an_fp8_activation(rows: int, dtype: torch.dtype, randn: Callable) -> None:
    """linear(Fp8Activation, Fp8Weight) = linear(x, Fp8Weight) where the activation is x's own quantization:
    the linear skips its quantize step and nothing else changes; the same on the reference path."""
    from pdserve.kernels.linear_fp8_triton import linear_fp8_triton

    x, w, bias = randn(rows, 96, dtype=dtype), quantize_weight_fp8(randn(80, 96) / 10), randn(80, dtype=dtype)
    act = _unfused(x)
    out, plain = linear_fp8_triton(act, w, bias), linear_fp8_triton(x, w, bias)
    assert out.dtype == dtype and out.shape == (rows, 80)
    assert torch.equal(out, plain)
    assert torch.equal(linear_fp8_ref(quantize_activation_ref(x), w, bias), linear_fp8_ref(x, w, bias))
    assert torch.equal(linear(act, w, bias), linear(x, w, bias))  # the dispatcher, whichever backend


def test_an_fp8_activation_needs_an_fp8_weight(randn: Callable) -> None:
    act = quantize_activation_ref(randn(2, 32))
    with pytest.raises(TypeError, match="needs an Fp8Weight"):
        linear(act, randn(16, 32))
    with pytest.raises(ValueError, match="scale must be float32"):
        Fp8Activation(act.q, act.scale[:1], torch.float32)
