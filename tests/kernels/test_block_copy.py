from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.block_copy import copy_blocks_ref, gather_blocks_ref, scatter_blocks_ref


@pytest.mark.parametrize("block_size,heads,dim,ids", [(16, 1, 64, [3]), (16, 3, 64, [0, 5, 2]), (4, 9, 48, [7, 1])])
def test_gather_blocks_matches_ref(
    block_size: int, heads: int, dim: int, ids: list[int], dtype: torch.dtype, randn: Callable, device: str
) -> None:
    from pdserve.kernels.block_copy_triton import gather_blocks_triton

    cache = randn(2, 8, block_size, heads, dim, dtype=dtype)
    block_ids = torch.tensor(ids, dtype=torch.int32, device=device)
    assert torch.equal(gather_blocks_triton(cache, block_ids), gather_blocks_ref(cache, block_ids))


@pytest.mark.parametrize("block_size,heads,dim,ids", [(16, 3, 64, [6, 0, 2]), (4, 9, 48, [1])])
def test_scatter_blocks_matches_ref(
    block_size: int, heads: int, dim: int, ids: list[int], dtype: torch.dtype, randn: Callable, device: str
) -> None:
    from pdserve.kernels.block_copy_triton import scatter_blocks_triton

    cache = randn(2, 8, block_size, heads, dim, dtype=dtype)
    blocks = randn(2, len(ids), block_size, heads, dim)  # fp32 in, converted to the cache's dtype
    block_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    expected = cache.clone()
    scatter_blocks_ref(expected, block_ids, blocks)
    scatter_blocks_triton(cache, block_ids, blocks)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("block_size,heads,dim,src,dst", [(16, 3, 64, [6, 0, 2], [1, 7, 3]), (4, 9, 48, [5], [5])])
def test_copy_blocks_between_caches_matches_ref(
    block_size: int, heads: int, dim: int, src: list[int], dst: list[int], dtype: torch.dtype, randn: Callable,
    device: str,
) -> None:
    from pdserve.kernels.block_copy_triton import copy_blocks_triton

    source = randn(2, 8, block_size, heads, dim, dtype=dtype)
    target = randn(2, 10, block_size, heads, dim, dtype=dtype)  # another pool, of another size
    src_ids = torch.tensor(src, dtype=torch.int64, device=device)
    dst_ids = torch.tensor(dst, dtype=torch.int32, device=device)
    expected = target.clone()
    copy_blocks_ref(source, src_ids, expected, dst_ids)
    copy_blocks_triton(source, src_ids, target, dst_ids)
    assert torch.equal(target, expected)
    assert torch.equal(target[:, dst], source[:, src])


def test_empty_gather_and_mismatched_scatter(randn: Callable, device: str) -> None:
    from pdserve.kernels.block_copy_triton import gather_blocks_triton, scatter_blocks_triton

    cache = randn(2, 4, 16, 2, 64)
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert gather_blocks_triton(cache, none).shape == (2, 0, 16, 2, 64)
    with pytest.raises(ValueError, match="blocks shape"):
        scatter_blocks_triton(cache, torch.tensor([1, 2], device=device), randn(2, 1, 16, 2, 64))
    from pdserve.kernels.block_copy_triton import copy_blocks_triton

    with pytest.raises(ValueError, match="destination ids"):
        copy_blocks_triton(cache, torch.tensor([1, 2], device=device), cache, torch.tensor([0], device=device))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_prepared_copy_over_layers_matches_ref(cache_dtype: torch.dtype, randn: Callable, device: str) -> None:
    """The KV sender's per-layer copy: set up once with the first pair, then one launch per layer pair."""
    from pdserve.kernels.block_copy_triton import PreparedCopy

    src_ids = torch.tensor([6, 0, 2], dtype=torch.int64, device=device)
    dst_ids = torch.tensor([1, 9, 3], dtype=torch.int64, device=device)
    sources = [randn(2, 8, 16, 3, 64).to(cache_dtype) for _ in range(3)]
    targets = [randn(2, 10, 16, 3, 64).to(cache_dtype) for _ in range(3)]
    expected = [t.clone() for t in targets]
    copy = PreparedCopy(sources[0], src_ids, targets[0], dst_ids)
    for source, target, want in zip(sources, targets, expected, strict=True):
        copy(source, target)
        copy_blocks_ref(source, src_ids, want, dst_ids)
        assert torch.equal(target.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(target[:, [1, 9, 3]].view(torch.uint8), source[:, [6, 0, 2]].view(torch.uint8))
    with pytest.raises(ValueError, match="laid out otherwise"):
        copy(sources[0], randn(2, 12, 16, 3, 64).to(cache_dtype))  # a pool of another size: other strides
    with pytest.raises(ValueError, match="laid out otherwise"):
        copy(sources[0].to(torch.float32), targets[0])


@pytest.mark.parametrize("shape", [(4, 2, 8), (3, 1, 5)])  # whole 8-byte words a block, and not
def test_fp8_scatter_ref_writes_each_block_whole(shape: tuple[int, int, int]) -> None:
    """The reference scatters 1-byte caches as words where a block is whole words, as bytes elsewhere."""
    codes = torch.randint(0, 255, (2, 6, *shape), dtype=torch.uint8)
    cache = codes.view(torch.float8_e4m3fn)
    blocks = torch.randint(0, 255, (2, 2, *shape), dtype=torch.uint8).view(torch.float8_e4m3fn)
    expected = codes.clone()
    expected[:, 4], expected[:, 1] = blocks.view(torch.uint8)[:, 0], blocks.view(torch.uint8)[:, 1]
    scatter_blocks_ref(cache, torch.tensor([4, 1]), blocks)
    assert torch.equal(cache.view(torch.uint8), expected)
