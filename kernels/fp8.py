"""The fp8 KV cache's numerics, shared by the kernels' references (the Triton kernels do the same math inline).

A cache of dtype float8_e4m3fn holds x / scale, saturated to +-448 (e4m3's largest finite value; torch and
Triton would otherwise turn an overflow into NaN), where `scale` is one float32 scalar per layer for K and one
for V (engine/kv_cache_spec.py says where they come from). Reading multiplies back: x ~= fp8 * scale. Every
other cache dtype stores x as it is and ignores the scales.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def quantize_kv_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) -> the cache's dtype: x * (1 / scale) saturated for fp8, a plain cast otherwise."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_kv_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values -> fp32; fp8 values are multiplied by their scale."""
    if not is_fp8(x.dtype):
        return x.float()
    return x.float() * scale
