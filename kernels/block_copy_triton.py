"""Triton block gather/scatter between the paged KV cache and a packed buffer.

One program copies BLOCK elements of one (K or V) half of one cache block; a block's
block_size * Hkv * D elements are contiguous in both layouts, so every access is a straight 16-byte stream.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _block_copy_kernel(
    src_ptr, dst_ptr, ids_ptr, num_ids, block_numel,
    src_stride_kv, src_stride_blk, dst_stride_kv, dst_stride_blk,
    GATHER: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
):
    # gather: src = kv_cache [2, num_blocks, E], dst = packed [2, n, E]; scatter: the other way round
    # (E = block_size * Hkv * D); grid: (n, 2, cdiv(E, BLOCK))
    i = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    block_id = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:
        src = src_ptr + kv * src_stride_kv + block_id * src_stride_blk + offs
        dst = dst_ptr + kv * dst_stride_kv + i * dst_stride_blk + offs
    else:
        src = src_ptr + kv * src_stride_kv + i * src_stride_blk + offs
        dst = dst_ptr + kv * dst_stride_kv + block_id * dst_stride_blk + offs
    if EVEN:
        tl.store(dst, tl.load(src).to(dst_ptr.dtype.element_ty))
    else:
        mask = offs < block_numel
        tl.store(dst, tl.load(src, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


def _check_blocks(t: torch.Tensor, name: str) -> None:
    if t.dim() != 5 or t.shape[0] != 2:
        raise ValueError(f"{name} must be [2, blocks, block_size, Hkv, D], got {tuple(t.shape)}")
    heads, dim = t.shape[3:]
    if t.stride(4) != 1 or t.stride(3) != dim or t.stride(2) != heads * dim:
        raise ValueError(f"{name} needs contiguous blocks (strides {t.stride()}, shape {tuple(t.shape)})")


def _copy(src, dst, block_ids, gather):
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be int32/int64, got {block_ids.dtype}")
    block_numel = src.shape[2] * src.shape[3] * src.shape[4]
    block = min(4096, triton.next_power_of_2(block_numel))
    n = block_ids.shape[0]
    if n == 0:
        return
    grid = (n, 2, triton.cdiv(block_numel, block))
    _block_copy_kernel[grid](
        src, dst, block_ids.to(src.device), n, block_numel,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        GATHER=gather, BLOCK=block, EVEN=block_numel % block == 0, num_warps=4,
    )


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    _check_blocks(kv_cache, "kv_cache")
    out = torch.empty((2, block_ids.shape[0], *kv_cache.shape[2:]), dtype=kv_cache.dtype, device=kv_cache.device)
    _copy(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    _check_blocks(kv_cache, "kv_cache")
    _check_blocks(blocks, "blocks")
    expected = (2, block_ids.shape[0], *kv_cache.shape[2:])
    if tuple(blocks.shape) != expected:
        raise ValueError(f"blocks shape {tuple(blocks.shape)} != {expected}")
    _copy(blocks, kv_cache, block_ids, gather=False)
