"""Linear layer y = x @ weight.T (+ bias).

linear(x, weight, bias=None)
# x: [num_tokens, K]; weight: [N, K]; bias: [N] or None -> [num_tokens, N]
On CUDA a GEMV / skinny-GEMM Triton kernel serves small batches where it beats cuBLAS; the dispatcher in
linear_triton decides by shape. Elsewhere this is torch's matmul.
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        from pdserve.kernels.linear_triton import linear_triton

        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)
