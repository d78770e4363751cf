"""RMSNorm, and residual-add fused with RMSNorm.

rms_norm(x, weight, eps)                    -> out
fused_add_rms_norm(x, residual, weight, eps) -> (out, x + residual)
# x, residual: [num_tokens, hidden]; weight: [hidden]
"""

from __future__ import annotations

import torch

from pdserve.kernels.dispatch import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(h, weight, eps), h


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
