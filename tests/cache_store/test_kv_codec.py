from __future__ import annotations

import zlib

import msgpack
import pytest
import torch

from pdserve.cache_store.kv_codec import (
    FORMAT_VERSION,
    BlockLayout,
    CorruptValueError,
    decode_block,
    encode_block,
    gather_to_host,
    scatter_from_host,
)
from tests.cache_store.kv_helpers import BS, DIM, HEADS, LAYERS, layout, random_blocks

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


def _value(lay: BlockLayout, block: torch.Tensor, payload: bytes | None = None, **header: object) -> bytes:
    raw = block.contiguous().view(torch.uint8).numpy().tobytes() if payload is None else payload
    fields = {"v": FORMAT_VERSION, "fp": lay.model_fingerprint, "hash": HASH, "dtype": "float32",
              "shape": list(lay.shape), "layers": lay.num_layers, "nbytes": len(raw), "checksum": zlib.crc32(raw)}
    fields.update(header)
    return msgpack.packb(fields, use_bin_type=True) + raw


def _corruptions(lay: BlockLayout, block: torch.Tensor) -> dict[str, bytes]:
    good = encode_block(lay, HASH, block)
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF
    small = random_blocks(1)[0, :2]
    return {
        "bad checksum": bytes(flipped),
        "truncated": good[:-7],
        "extra bytes": good + b"\x00",
        "wrong shape": _value(lay, small, shape=list(small.shape), layers=2),
        "nbytes lies": _value(lay, block, nbytes=10**12),
        "another model": _value(lay, block, fp="other-model:fp32"),
        "format version": _value(lay, block, v=FORMAT_VERSION + 1),
        "another block": _value(lay, block, hash=b"\x01" * 16),
        "wrong dtype": _value(lay, block, dtype="float16"),
        "not msgpack": b"\xc1" * 64,
        "header only": msgpack.packb({"v": FORMAT_VERSION}),
        "not a map": msgpack.packb([1, 2, 3]) + b"x" * 10,
        "empty": b"",
    }


@pytest.mark.parametrize("kind", ["bad checksum", "truncated", "extra bytes", "wrong shape", "nbytes lies",
                                  "another model", "format version", "another block", "wrong dtype", "not msgpack",
                                  "header only", "not a map", "empty"])
def test_corrupt_values_are_refused_before_any_copy(kind: str) -> None:
    lay = layout()
    block = random_blocks(1)[0]
    out = torch.full_like(block, 7.0)
    with pytest.raises(CorruptValueError):
        decode_block(lay, HASH, _corruptions(lay, block)[kind], out)
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
