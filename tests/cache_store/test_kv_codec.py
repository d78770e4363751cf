from __future__ import annotations

import pytest
import torch

from pdserve.cache_store.kv_codec import (
    BlockLayout,
    CorruptValueError,
    decode_block,
    encode_block,
    gather_to_host,
    scatter_from_host,
)
from tests.cache_store.kv_helpers import (
    BS,
    CORRUPTIONS,
    DIM,
    HEADS,
    LAYERS,
    corrupt_value,
    layout,
    random_blocks,
)

HASH = bytes(range(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact(dtype: torch.dtype) -> None:
    lay = layout(dtype)
    block = random_blocks(1, dtype)[0]
    value = encode_block(lay, HASH, block)
    assert len(value) < lay.nbytes + 200, "header is small"
    out = torch.full_like(block, float("nan"))
    decode_block(lay, HASH, value, out)
    assert torch.equal(out.view(torch.uint8), block.view(torch.uint8))


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_values_are_refused_before_any_copy(kind: str) -> None:
    lay = layout()
    block = random_blocks(1)[0]
    out = torch.full_like(block, 7.0)
    with pytest.raises(CorruptValueError):
        decode_block(lay, HASH, corrupt_value(lay, block, HASH, kind), out)
    assert bool((out == 7.0).all()), "nothing written into the destination"


def test_layout_checks_and_pool_shape() -> None:
    pool = [torch.zeros(2, 5, BS, HEADS, DIM, dtype=torch.float16) for _ in range(LAYERS)]
    lay = BlockLayout.of_pool(pool, "fp")
    assert lay.shape == (LAYERS, 2, BS, HEADS, DIM) and lay.nbytes == LAYERS * 2 * BS * HEADS * DIM * 2
    with pytest.raises(ValueError, match="cannot be stored"):
        BlockLayout("fp", 1, 1, 1, 1, torch.int32)
    with pytest.raises(ValueError, match="does not match layout"):
        encode_block(layout(), HASH, random_blocks(1, torch.float16)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_then_scatter_moves_exact_blocks(dtype: torch.dtype) -> None:
    pool = [torch.randn(2, 8, BS, HEADS, DIM).to(dtype) for _ in range(LAYERS)]
    staging = layout(dtype).empty(3)
    assert gather_to_host(pool, [5, 1, 6], staging) is None
    for layer in range(LAYERS):
        assert torch.equal(staging[:, layer], pool[layer][:, [5, 1, 6]].transpose(0, 1))
    other = [torch.zeros_like(kv) for kv in pool]
    scatter_from_host(other, [0, 2, 4], staging)
    for layer in range(LAYERS):
        assert torch.equal(other[layer][:, [0, 2, 4]], pool[layer][:, [5, 1, 6]])
        assert not other[layer][:, [1, 3, 5, 6, 7]].any()
