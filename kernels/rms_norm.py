"""RMSNorm, and residual-add fused with RMSNorm.

rms_norm(x, weight, eps)                    -> out
fused_add_rms_norm(x, residual, weight, eps) -> (out, x + residual)
rms_norm_fp8(x, weight, eps)                -> Fp8Activation of out (kernels/fp8_activation.py)
fused_add_rms_norm_fp8(x, residual, weight, eps) -> (Fp8Activation of out, x + residual)
# x, residual: [num_tokens, hidden]; weight: [hidden]

The _fp8 forms feed an fp8 linear: out is rounded to x's dtype, then quantized per row (e4m3 codes, scale =
amax / 448) in the same pass, so the linear skips its own quantization kernel; codes and scales equal
quantize_rows_fp8_ref(out).
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8_activation import Fp8Activation, quantize_activation_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(h, weight, eps), h


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activation:
    return quantize_activation_ref(rms_norm_ref(x, weight, eps))


def fused_add_rms_norm_fp8_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activation, torch.Tensor]:
    out, h = fused_add_rms_norm_ref(x, residual, weight, eps)
    return quantize_activation_ref(out), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from pdserve.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        from pdserve.kernels.rms_norm_triton import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Activation:
    if use_triton(x):
        from pdserve.kernels.rms_norm_triton import rms_norm_fp8_triton

        return rms_norm_fp8_triton(x, weight, eps)
    return rms_norm_fp8_ref(x, weight, eps)


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Activation, torch.Tensor]:
    if use_triton(x):
        from pdserve.kernels.rms_norm_triton import fused_add_rms_norm_fp8_triton

        return fused_add_rms_norm_fp8_triton(x, residual, weight, eps)
    return fused_add_rms_norm_fp8_ref(x, residual, weight, eps)
