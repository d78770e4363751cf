"""The fp8 KV cache's numerics, shared by the kernels' references (the Triton kernels do the same math inline).

A cache of dtype float8_e4m3fn holds x / scale, saturated to +-448 (e4m3's largest finite value; torch and
Triton would otherwise turn an overflow into NaN), where `scale` is one float32 scalar per layer for K and one
for V (engine/kv_cache_spec.py says where they come from). Reading multiplies back: x ~= fp8 * scale. Every
other cache dtype stores x as it is and ignores the scales.

An fp8 cache also lays its blocks out otherwise, head-major: each block's V half holds [Hkv, D, PAGE] (a head's
values of one dimension for the page's tokens, contiguous) and its K half [Hkv, PAGE, D] (a head's page one run),
where every other cache holds [PAGE, Hkv, D] in both; the pool's shape is the same. p.V's right operand then has
its tokens contiguous in memory, which an 8-bit operand needs (no transposing load exists for 8-bit elements:
decode attention read V one byte a load before, 220.6 against 198.2 us a layer at B 64, ctx 4,096 on an H100),
and a head's keys of one page are one 2 KB run instead of 16 runs of 128 bytes (2-4 % off decode attention
at every shape measured; docs/quantization.md). The kernels address K through strides (`cache_strides`) and V
through the layout; blocks still move as opaque bytes (transfers, tiers, block copies); the writer
(kernels/rope*.py) and the references (through `fp8_k_tokens`, `fp8_v_tokens`) follow the layout, and the KV
compatibility key names it (engine/kv_cache_spec.py).
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


def cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The (K/V half, block, token, head) strides by which the kernels address K and a non-fp8 cache's V: the
    tensor's own, except an fp8 cache's K, stored [Hkv, PAGE, D] in each block (blocks must then be dense)."""
    strides = kv_cache.stride()
    if not is_fp8(kv_cache.dtype):
        return strides[0], strides[1], strides[2], strides[3]
    page, heads, dim = kv_cache.shape[2:]
    if strides[1:] != (page * heads * dim, heads * dim, dim, 1):
        raise ValueError(f"an fp8 cache's blocks must be dense [PAGE, Hkv, D] bytes, got strides {strides}")
    return strides[0], strides[1], dim, page * dim


def fp8_k_tokens(k_blocks: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's K blocks ([N, PAGE, Hkv, D]-shaped, holding [N, Hkv, PAGE, D], contiguous) as the
    [N, PAGE, Hkv, D] view of token-major values. Other dtypes: as they are."""
    if not is_fp8(k_blocks.dtype):
        return k_blocks
    n, page, heads, dim = k_blocks.shape
    return k_blocks.reshape(n, heads, page, dim).transpose(1, 2)


def fp8_k_stored(k_tokens: torch.Tensor) -> torch.Tensor:
    """fp8_k_tokens' inverse: token-major K blocks [N, PAGE, Hkv, D] -> a contiguous tensor of that shape holding
    the stored layout. Other dtypes: as they are."""
    if not is_fp8(k_tokens.dtype):
        return k_tokens
    raw = k_tokens.view(torch.uint8)  # permuted copies of fp8 go through bytes (CPU kernels lack some fp8 ops)
    return raw.transpose(1, 2).contiguous().view(k_tokens.shape).view(k_tokens.dtype)


def fp8_v_tokens(v_blocks: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's V blocks ([N, PAGE, Hkv, D]-shaped, holding [N, Hkv, D, PAGE], contiguous) as the
    [N, PAGE, Hkv, D] view of token-major values. Other dtypes: as they are."""
    if not is_fp8(v_blocks.dtype):
        return v_blocks
    n, page, heads, dim = v_blocks.shape
    return v_blocks.reshape(n, heads, dim, page).permute(0, 3, 1, 2)


def fp8_v_stored(v_tokens: torch.Tensor) -> torch.Tensor:
    """fp8_v_tokens' inverse: token-major V blocks [N, PAGE, Hkv, D] -> a contiguous tensor of that shape holding
    the stored layout (tests and benchmarks build caches with it). Other dtypes: as they are."""
    if not is_fp8(v_tokens.dtype):
        return v_tokens
    raw = v_tokens.view(torch.uint8)  # permuted copies of fp8 go through bytes (CPU kernels lack some fp8 ops)
    return raw.permute(0, 2, 3, 1).contiguous().view(v_tokens.shape).view(v_tokens.dtype)
