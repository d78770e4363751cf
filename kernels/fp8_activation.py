"""A linear layer's input already quantized per row (token) to fp8, as the fused producers emit it.

    rms_norm_fp8 / fused_add_rms_norm_fp8 (kernels/rms_norm.py), silu_and_mul_fp8 (kernels/activation.py)
        ──▶ Fp8Activation(q [M, K] e4m3, scale [M] fp32, dtype)  ──▶ linear(x, Fp8Weight) skips its own quantize

The codes and scales are those of quantize_rows_fp8_ref applied to the producer's unfused output (rounded to
`dtype` first), so a linear fed an Fp8Activation computes what it computes from that output. `dtype` is the
dtype the unquantized activation would have had: the linear's output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.fp8_weight import FP8_DTYPE, quantize_rows_fp8_ref


@dataclass(frozen=True)
class Fp8Activation:
    """x [M, K] as e4m3 codes with one fp32 scale a row: x[m, :] ≈ q[m, :] * scale[m]."""

    q: torch.Tensor  # [M, K] float8_e4m3fn, unit stride along K
    scale: torch.Tensor  # [M] float32
    dtype: torch.dtype  # of the unquantized x, and so of the linear's output

    def __post_init__(self) -> None:
        if self.q.dtype != FP8_DTYPE or self.q.dim() != 2:
            raise ValueError(f"Fp8Activation.q must be a 2-D {FP8_DTYPE}, got {self.q.dtype} {tuple(self.q.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.q.shape[0],):
            raise ValueError(f"Fp8Activation.scale must be float32 [{self.q.shape[0]}], got {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """fp32 [M, K]: what the W8A8 product multiplies."""
        return self.q.float() * self.scale[:, None]


def quantize_activation_ref(x: torch.Tensor) -> Fp8Activation:
    """x [..., K] -> its rows as an Fp8Activation (quantize_rows_fp8_ref)."""
    q, scale = quantize_rows_fp8_ref(x.reshape(-1, x.shape[-1]))
    return Fp8Activation(q, scale, x.dtype)
