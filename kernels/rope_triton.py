"""Triton RoPE (neox rotate-half) fused with the paged KV-cache write.

One program per token: it rotates the token's query and key heads in place and writes the rotated keys,
with the raw value heads, straight into the token's cache slot (the in-place keys are what SDPA reads for an
uncached prompt: kernels/prefill_attention.py). Any even head_dim works (the half is padded to a power of two and masked).

An fp8 cache (FP8, from the cache's dtype) gets the rounded key (as stored in k) and the value times the layer's
inverse scale, saturated to +-448: the same numbers as kernels/fp8.quantize_kv_ref; its K goes to the fp8
layout's [Hkv, PAGE, D] rows (through the strides of kernels/fp8.cache_strides), its V to the [Hkv, D, PAGE]
column of the token (kernels/fp8.py).

What is compiled: one kernel per model, dtype and cache dtype. The constexprs are head counts, half the head dim and the
page size; the integer arguments are strides of q/k/v (views of the fused qkv output: its row width) and of
the cos/sin table and KV pool, none of which depends on the batch; the token count is only the grid.
"""

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import cache_strides, is_fp8
from pdserve.kernels.pdl import launch_options


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_ckv, stride_cblk, stride_ctok, stride_ch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # q, k: [T, Hq|Hkv, D] (rotated in place); v: [T, Hkv, D]; positions, slot_mapping: [T]; cos_sin: [max_pos, D]
    # cache: [2, num_blocks, PAGE, Hkv, D]; grid: (T,)
    if PDL:  # kernels/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq < NUM_Q_HEADS)[:, None] & d_mask[None, :]
    q_ptrs = q_ptr + t * stride_qt + hq[:, None] * stride_qh + d[None, :]  # [BLOCK_HQ, BLOCK_HALF]
    q1 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_ptrs, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptrs + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    hk = tl.arange(0, BLOCK_HKV)
    kv_mask = (hk < NUM_KV_HEADS)[:, None] & d_mask[None, :]
    k_ptrs = k_ptr + t * stride_kt + hk[:, None] * stride_kh + d[None, :]  # [BLOCK_HKV, BLOCK_HALF]
    k1 = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptrs + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
    tl.store(k_ptrs, k1.to(k_ptr.dtype.element_ty), mask=kv_mask)  # in place too: SDPA reads k from here
    tl.store(k_ptrs + HALF, k2.to(k_ptr.dtype.element_ty), mask=kv_mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        v_ptrs = v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :]
        v1 = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptrs + HALF, mask=kv_mask, other=0.0)
        dst = cache_ptr + (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ctok
        dst = dst + hk[:, None] * stride_ch + d[None, :]
        out_ty = cache_ptr.dtype.element_ty
        if FP8:  # from the keys as rounded into k, so the cache holds what the reference quantizes
            k1 = _fp8(k1.to(k_ptr.dtype.element_ty).to(tl.float32) * inv_k_scale)
            k2 = _fp8(k2.to(k_ptr.dtype.element_ty).to(tl.float32) * inv_k_scale)
            v1 = _fp8(v1.to(tl.float32) * inv_v_scale)
            v2 = _fp8(v2.to(tl.float32) * inv_v_scale)
        tl.store(dst, k1.to(out_ty), mask=kv_mask)
        tl.store(dst + HALF, k2.to(out_ty), mask=kv_mask)
        if FP8:  # V stored [Hkv, D, PAGE] in each block (kernels/fp8.py): this token's column of it
            v_dst = cache_ptr + stride_ckv + (slot // PAGE) * stride_cblk + slot % PAGE
            v_dst = v_dst + hk[:, None] * (2 * HALF * PAGE) + d[None, :] * PAGE
            tl.store(v_dst, v1.to(out_ty), mask=kv_mask)
            tl.store(v_dst + HALF * PAGE, v2.to(out_ty), mask=kv_mask)
        else:
            tl.store(dst + stride_ckv, v1.to(out_ty), mask=kv_mask)
            tl.store(dst + stride_ckv + HALF, v2.to(out_ty), mask=kv_mask)


@triton.jit
def _fp8(x):
    # saturate to e4m3's finite range: the conversion would turn an overflow into NaN
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


def _check(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping):
    tokens, _, dim = q.shape
    if dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {dim}")
    if k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != dim:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T={tokens}, Hkv, D={dim}]")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [2, blocks, block_size, {k.shape[1]}, {dim}]")
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} / slot_mapping {tuple(slot_mapping.shape)} != ({tokens},)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_positions, {dim}], unit stride")
    for name, t in (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride along head_dim, got strides {t.stride()}")


def rope_kv_write_triton(
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
    _check(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping)
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    if tokens == 0:
        return q
    _rope_kv_write_kernel[(tokens,)](
        q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        *cache_strides(kv_cache),  # an fp8 cache's K head-major (kernels/fp8.py)
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=dim // 2, PAGE=kv_cache.shape[2],
        FP8=is_fp8(kv_cache.dtype), BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(dim // 2), num_warps=4, **launch_options(q.device),
    )
    return q
