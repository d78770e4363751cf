"""Triton block gather/scatter between the paged KV cache and a packed buffer.

One program copies BLOCK elements of one (K or V) half of one cache block; a block's
block_size * Hkv * D elements are contiguous in both layouts, so every access is a straight 16-byte stream.

What is compiled: per pool layout, one kernel per direction (gather, scatter, copy: the *_INDEXED flags) and
BLOCK/EVEN (from the block's element count). The block count is only the grid; the strides are the pools'
(a peer's pool over CUDA IPC has its own block count, hence its own stride: one kernel per peer layout). Id
tensors must start 16-byte aligned, as fresh tensors do: a view at an odd int64 offset (ids[1] of a [2, n]
tensor with n odd) compiles a second kernel; kv_transfer/cuda_ipc/sender.py pads its id rows for that.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _block_copy_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, block_numel,
    src_stride_kv, src_stride_blk, dst_stride_kv, dst_stride_blk,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
):
    # src, dst: [2, blocks, E] (E = block_size * Hkv * D); program i copies block src_ids[i] (or i) of src to
    # block dst_ids[i] (or i) of dst. gather: a cache into a packed buffer (SRC_INDEXED); scatter: a packed buffer
    # into a cache (DST_INDEXED); copy: a cache into another cache, e.g. a peer's pool over CUDA IPC (both).
    # grid: (n, 2, cdiv(E, BLOCK))
    i = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    src_block = i.to(tl.int64)
    dst_block = i.to(tl.int64)
    if SRC_INDEXED:
        src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    if DST_INDEXED:
        dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    src = src_ptr + kv * src_stride_kv + src_block * src_stride_blk + offs
    dst = dst_ptr + kv * dst_stride_kv + dst_block * dst_stride_blk + offs
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


def _check_ids(block_ids: torch.Tensor) -> None:
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be int32/int64, got {block_ids.dtype}")


def _copy(src, dst, src_ids, dst_ids, n, block=4096, num_warps=4):
    # block, num_warps: elements and warps per program (benchmarks/engine_gpu_copy_sweep.py measures others)
    for ids in (src_ids, dst_ids):
        if ids is not None:
            _check_ids(ids)
    block_numel = src.shape[2] * src.shape[3] * src.shape[4]
    block = min(block, triton.next_power_of_2(block_numel))
    if n == 0:
        return
    grid = (n, 2, triton.cdiv(block_numel, block))
    # a missing id list is never read (its constexpr flag is off): any tensor stands in for the pointer
    src_arg = src_ids.to(src.device) if src_ids is not None else src
    dst_arg = dst_ids.to(src.device) if dst_ids is not None else src
    _block_copy_kernel[grid](
        src, dst, src_arg, dst_arg, block_numel,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None,
        BLOCK=block, EVEN=block_numel % block == 0, num_warps=num_warps,
    )


class PreparedCopy:
    """copy_blocks_triton with one pair of id lists between many cache pairs of one layout (a KV transfer's
    layers: P's pool[i] -> D's pool[i]): the ids, shapes and launch arguments checked and worked out once, so
    each pair is a layout comparison and one launch (the sender calls it on the prefill step thread, per layer)."""

    def __init__(self, src_cache: torch.Tensor, src_ids: torch.Tensor, dst_cache: torch.Tensor,
                 dst_ids: torch.Tensor, block: int = 4096, num_warps: int = 4) -> None:
        _check_blocks(src_cache, "src_cache")
        _check_blocks(dst_cache, "dst_cache")
        for ids in (src_ids, dst_ids):
            _check_ids(ids)
        if tuple(src_cache.shape[2:]) != tuple(dst_cache.shape[2:]) or src_ids.shape != dst_ids.shape:
            raise ValueError(f"copy of blocks {tuple(src_cache.shape)} -> {tuple(dst_cache.shape)} with "
                             f"{tuple(src_ids.shape)} source and {tuple(dst_ids.shape)} destination ids")
        self._layouts = (_layout(src_cache), _layout(dst_cache))
        self._ids = (src_ids.to(src_cache.device), dst_ids.to(src_cache.device))
        block_numel = src_cache.shape[2] * src_cache.shape[3] * src_cache.shape[4]
        block = min(block, triton.next_power_of_2(block_numel))
        self._n = src_ids.shape[0]
        self._launch = _block_copy_kernel[(self._n, 2, triton.cdiv(block_numel, block))]
        self._args = (block_numel, src_cache.stride(0), src_cache.stride(1), dst_cache.stride(0), dst_cache.stride(1))
        self._meta = {"SRC_INDEXED": True, "DST_INDEXED": True, "BLOCK": block, "EVEN": block_numel % block == 0,
                      "num_warps": num_warps}

    def __call__(self, src_cache: torch.Tensor, dst_cache: torch.Tensor) -> None:
        """Blocks src_ids[i] of src_cache -> dst_ids[i] of dst_cache; both laid out as the caches given first
        (ValueError otherwise)."""
        if (_layout(src_cache), _layout(dst_cache)) != self._layouts:
            raise ValueError(f"caches {tuple(src_cache.shape)} -> {tuple(dst_cache.shape)} laid out otherwise than "
                             f"the prepared copy's {self._layouts}")
        if self._n:
            self._launch(src_cache, dst_cache, *self._ids, *self._args, **self._meta)


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    _check_blocks(kv_cache, "kv_cache")
    out = torch.empty((2, block_ids.shape[0], *kv_cache.shape[2:]), dtype=kv_cache.dtype, device=kv_cache.device)
    _copy(kv_cache, out, block_ids, None, block_ids.shape[0])
    return out


def scatter_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    _check_blocks(kv_cache, "kv_cache")
    _check_blocks(blocks, "blocks")
    expected = (2, block_ids.shape[0], *kv_cache.shape[2:])
    if tuple(blocks.shape) != expected:
        raise ValueError(f"blocks shape {tuple(blocks.shape)} != {expected}")
    _copy(blocks, kv_cache, None, block_ids, block_ids.shape[0])


def copy_blocks_triton(src_cache: torch.Tensor, src_ids: torch.Tensor, dst_cache: torch.Tensor,
                       dst_ids: torch.Tensor, block: int = 4096, num_warps: int = 4) -> None:
    """Runs on src_cache's device; dst_cache may live on a peer GPU (mapped through CUDA IPC with peer access):
    each program then stores its block over NVLink. One PreparedCopy, used once."""
    PreparedCopy(src_cache, src_ids, dst_cache, dst_ids, block, num_warps)(src_cache, dst_cache)
