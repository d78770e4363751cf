"""Rotary position embedding (neox / rotate-half layout, llama3 scaling) fused with the paged KV-cache write.

rope_kv_write(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping) -> q
# q: [T, Hq, D] rotated in place and returned; k: [T, Hkv, D] rotated in place; v: [T, Hkv, D]; positions: [T]
# cos_sin_cache: [max_positions, D] fp32, cos in [:, :D/2], sin in [:, D/2:]
# kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64, slot = block * block_size + offset;
#   a negative slot means "do not write" (padding)
# k_scale, v_scale: the layer's fp8 scales (kernels/fp8.py); ignored unless kv_cache is float8_e4m3fn
Rotated k and raw v land in kv_cache at their slots (an fp8 cache gets k / k_scale and v / v_scale, saturated).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from pdserve.kernels.dispatch import use_triton
from pdserve.kernels.fp8 import is_fp8, quantize_kv_ref


class RopeScaling(Protocol):
    """What the scaled frequencies read (engine/config.py's Llama3RopeScaling has these fields)."""

    @property
    def factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float()
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_low = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_low / scaling.factor + smooth * inv_low
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, inv_low).float()


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    inv = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    keys = quantize_kv_ref(k[keep], k_scale, kv_cache.dtype)
    values = quantize_kv_ref(v[keep], v_scale, kv_cache.dtype)
    if is_fp8(kv_cache.dtype):  # K stored [Hkv, PAGE, D], V [Hkv, D, PAGE] in each block (kernels/fp8.py), as bytes
        blocks, rows = slots // block_size, slots % block_size
        kv_cache[0].view(torch.uint8).view(num_blocks, heads, block_size, dim)[blocks, :, rows] = keys.view(torch.uint8)
        stored = kv_cache[1].view(torch.uint8).view(num_blocks, heads, dim, block_size)
        stored[blocks, :, :, rows] = values.view(torch.uint8)
    else:
        flat[0, slots] = keys
        flat[1, slots] = values


def rope_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    q.copy_(apply_rope_ref(q, positions, cos_sin_cache))
    k.copy_(apply_rope_ref(k, positions, cos_sin_cache))
    write_kv_ref(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    if use_triton(q):
        from pdserve.kernels.rope_triton import rope_kv_write_triton

        return rope_kv_write_triton(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale)
    return rope_kv_write_ref(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, k_scale, v_scale)
