"""Linear layer over an fp8 weight: y = x @ dequant(W).T (+ bias), x in its own dtype, y in x's dtype.

linear_fp8(x, weight: Fp8Weight, bias=None)
# x: [..., K]; weight.weight: [N, K] e4m3, weight.scale: [N] fp32; bias: [N] or None -> [..., N]

Two numerics, chosen by the number of rows M (the same rule on every backend, so a CPU run computes what
the GPU computes):
    M <= FP8_WEIGHT_ONLY_MAX_ROWS: weight-only, x @ (Wq * s).T, accumulated in fp32
    M >  FP8_WEIGHT_ONLY_MAX_ROWS: W8A8, (xq * sx) @ (Wq * s).T, x quantized per row at each call (dynamic),
                                   accumulated in fp32
x may also be an Fp8Activation (kernels/fp8_activation.py: quantized by the kernel that produced it, rms_norm_fp8
or silu_and_mul_fp8): then the W8A8 product runs on its codes and scales as they are, with no quantization step;
it must have more than FP8_WEIGHT_ONLY_MAX_ROWS rows (the weight-only rows take x unquantized).
FP8_WEIGHT_ONLY_MAX_ROWS is 0 (kernels/fp8_weight.py says why, with the H200 numbers): every batch is W8A8.
On CUDA kernels/linear_fp8_triton.py runs them (a GEMV with the fp8 weight upcast in registers; a Triton
GEMM with fp8 tensor-core dots and both scales applied in the epilogue); elsewhere the references below.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import (
    FP8_WEIGHT_ONLY_MAX_ROWS,
    Fp8Weight,
    quantize_rows_fp8_ref,
)


def quantizes_activations(num_rows: int) -> bool:
    """W8A8 (True) or weight-only (False) for a product of this many rows."""
    return num_rows > FP8_WEIGHT_ONLY_MAX_ROWS


def check_quantized_rows(x: Fp8Activation) -> None:
    if x.shape[0] and not quantizes_activations(x.shape[0]):
        raise ValueError(f"an Fp8Activation of {x.shape[0]} rows: up to {FP8_WEIGHT_ONLY_MAX_ROWS} rows the fp8 "
                         f"linear is weight-only and takes x unquantized")


def linear_fp8_ref(x: torch.Tensor | Fp8Activation, weight: Fp8Weight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize and multiply in fp32 (x quantized first when quantizes_activations(rows))."""
    if isinstance(x, Fp8Activation):
        check_quantized_rows(x)
        out = x.dequantize() @ weight.dequantized().T
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if quantizes_activations(x2.shape[0]):
        xq, sx = quantize_rows_fp8_ref(x2)
        xf = xq.float() * sx[:, None]
    else:
        xf = x2.float()
    out = xf @ weight.dequantized().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def linear_fp8(x: torch.Tensor | Fp8Activation, weight: Fp8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x.q if isinstance(x, Fp8Activation) else x):
        from pdserve.kernels.linear_fp8_triton import linear_fp8_triton

        return linear_fp8_triton(x, weight, bias)
    return linear_fp8_ref(x, weight, bias)
