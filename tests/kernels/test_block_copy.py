from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref


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


def test_empty_gather_and_mismatched_scatter(randn: Callable, device: str) -> None:
    from pdserve.kernels.block_copy_triton import gather_blocks_triton, scatter_blocks_triton

    cache = randn(2, 4, 16, 2, 64)
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert gather_blocks_triton(cache, none).shape == (2, 0, 16, 2, 64)
    with pytest.raises(ValueError, match="blocks shape"):
        scatter_blocks_triton(cache, torch.tensor([1, 2], device=device), randn(2, 1, 16, 2, 64))
