"""Linear layer y = x @ weight.T (+ bias).

linear(x, weight, bias=None)
# x: [num_tokens, K], or an Fp8Activation (kernels/fp8_activation.py: x already quantized per row, fp8 weights
#    only); weight: [N, K] tensor, or an Fp8Weight (kernels/fp8_weight.py); bias: [N] or None
# -> [num_tokens, N] in x's dtype
On CUDA a GEMV / skinny-GEMM Triton kernel serves small batches where it beats cuBLAS; the dispatcher in
linear_triton decides by shape. Elsewhere this is torch's matmul. An Fp8Weight goes to kernels/linear_fp8.py
(W8A8: per-token quantization + fp8 GEMM, the quantization skipped for an Fp8Activation), whichever the backend.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8_activation import Fp8Activation
from pdserve.kernels.fp8_weight import Fp8Weight
from pdserve.kernels.linear_fp8 import linear_fp8


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor | Fp8Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, Fp8Weight):
        return linear_fp8(x, weight, bias)
    if isinstance(x, Fp8Activation):
        raise TypeError(f"an fp8-quantized input {tuple(x.shape)} needs an Fp8Weight, got a {weight.dtype} weight")
    if use_triton(x):
        from pdserve.kernels.linear_triton import linear_triton

        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)
