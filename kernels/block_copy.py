"""Block gather/scatter between a paged KV cache and a packed buffer (KV transfer, cache tiers).

gather_blocks(kv_cache, block_ids) -> blocks
scatter_blocks(kv_cache, block_ids, blocks) -> None
copy_blocks(src_cache, src_ids, dst_cache, dst_ids) -> None      block src_ids[i] of src -> dst_ids[i] of dst
prepare_copy(src_cache, src_ids, dst_cache, dst_ids) -> copy(src, dst)   the same ids between many pairs of
                                                                         caches laid out as these two
# kv_cache: [2, num_blocks, block_size, Hkv, D]; block_ids: [n] int64; blocks: [2, n, block_size, Hkv, D]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels.dispatch import use_triton


# index_select / index_copy_ copy whole blocks; `kv_cache[:, ids]` indexing copies element by element: 2.5x and
# 1.5x slower for 289 fp32 blocks of SmolLM2-135M (7 MB) on one CPU thread (benchmarks/decode_step_cpu.py)
def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return kv_cache.index_select(1, block_ids.long())


def _index_copy(dst: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """dst.index_copy_ along the block dim; 1-byte caches (fp8) as 8-byte words where both sides' blocks are
    whole contiguous words, else as bytes: torch's CPU index_copy_ lacks fp8 ("not implemented for
    'Float8_e4m3fn'", torch 2.13) and copies bytes one at a time (8 MiB of blocks: 13.1 ms as uint8, 1.5 as
    int64 on the dev box, one thread)."""
    blocks = blocks.to(dst.device, dst.dtype)
    if dst.element_size() == 1 and dst.dtype != torch.uint8:
        dst, blocks = dst.view(torch.uint8), blocks.view(torch.uint8)
        if _whole_words(dst) and _whole_words(blocks):
            dst, blocks = dst.flatten(2).view(torch.int64), blocks.flatten(2).view(torch.int64)
    dst.index_copy_(1, ids, blocks)


def _whole_words(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t[0, 0].numel() % 8 == 0 if t.shape[1] else False


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    _index_copy(kv_cache, block_ids.long(), blocks)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    if use_triton(kv_cache):
        from pdserve.kernels.block_copy_triton import gather_blocks_triton

        return gather_blocks_triton(kv_cache, block_ids)
    return gather_blocks_ref(kv_cache, block_ids)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    if use_triton(kv_cache):
        from pdserve.kernels.block_copy_triton import scatter_blocks_triton

        scatter_blocks_triton(kv_cache, block_ids, blocks)
        return
    scatter_blocks_ref(kv_cache, block_ids, blocks)


def copy_blocks_ref(src_cache: torch.Tensor, src_ids: torch.Tensor, dst_cache: torch.Tensor,
                    dst_ids: torch.Tensor) -> None:
    blocks = src_cache.index_select(1, src_ids.long().to(src_cache.device))
    _index_copy(dst_cache, dst_ids.long().to(dst_cache.device), blocks)


def copy_blocks(src_cache: torch.Tensor, src_ids: torch.Tensor, dst_cache: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """One pass from cache to cache (KV transfer into a peer's pool): half the traffic of gather + scatter."""
    if use_triton(src_cache):
        from pdserve.kernels.block_copy_triton import copy_blocks_triton

        copy_blocks_triton(src_cache, src_ids, dst_cache, dst_ids)
        return
    copy_blocks_ref(src_cache, src_ids, dst_cache, dst_ids)


def prepare_copy(src_cache: torch.Tensor, src_ids: torch.Tensor, dst_cache: torch.Tensor,
                 dst_ids: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """copy_blocks with these ids, checked and set up once for caches laid out as these two: the returned
    copy(src, dst) is one launch a call (a KV transfer's layers; copy_blocks checks and sets up every call)."""
    if use_triton(src_cache):
        from pdserve.kernels.block_copy_triton import PreparedCopy

        return PreparedCopy(src_cache, src_ids, dst_cache, dst_ids)
    return lambda src, dst: copy_blocks_ref(src, src_ids, dst, dst_ids)
