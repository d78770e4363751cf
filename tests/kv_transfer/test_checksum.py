"""kv_transfer/checksum.py: piecewise CRC-32 equals zlib.crc32 of the whole, however the bytes arrive; and P's
staged layers (kv_transfer/staging.py) use it after their one waiting thread."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import zlib

import pytest
import torch

from pdserve.kv_transfer import checksum
from pdserve.kv_transfer.checksum import (
    INLINE_BYTES,
    PIECE_BYTES,
    PieceSums,
    combine,
    combine_pieces,
    pieces,
    whole_buffer_piece_bytes,
)
from pdserve.kv_transfer.staging import StagedBlocks

SIZES = [0, 1, 7, INLINE_BYTES - 1, INLINE_BYTES, PIECE_BYTES - 1, PIECE_BYTES, PIECE_BYTES + 1,
         3 * PIECE_BYTES + 12_345, 4 * PIECE_BYTES]


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.mark.parametrize(("len_a", "len_b"), [(0, 0), (1, 0), (0, 1), (1000, 777), (5, 1 << 16), (1 << 16, 3)])
def test_combine_is_zlibs_crc_of_the_concatenation(len_a: int, len_b: int) -> None:
    a, b = data(len_a, 1), data(len_b, 2)
    assert combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)


@pytest.mark.parametrize("piece_bytes", [PIECE_BYTES, 4 * PIECE_BYTES])
@pytest.mark.parametrize("n", SIZES + [16 * PIECE_BYTES + 9])
def test_pieces_cover_the_payload_and_combine_to_its_crc(n: int, piece_bytes: int) -> None:
    spans = pieces(n, piece_bytes)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(end - start == piece_bytes for start, end in spans[1:])
    payload = data(n)
    assert combine_pieces([zlib.crc32(payload[s:e]) for s, e in spans], piece_bytes) == zlib.crc32(payload)


def test_a_whole_buffer_is_one_piece_per_sums_thread_of_a_power_of_two_size() -> None:
    threads = checksum.SUMS_THREADS
    assert whole_buffer_piece_bytes(1000) == PIECE_BYTES
    for n in (16 << 20, 8 << 20, 12 << 20, (16 << 20) + 1, 512 << 20):
        size = whole_buffer_piece_bytes(n)
        assert size >= PIECE_BYTES and size & (size - 1) == 0
        assert len(pieces(n, size)) <= threads or size == PIECE_BYTES
        assert size == PIECE_BYTES or len(pieces(n, size // 2)) > threads  # the smallest such size


@pytest.mark.parametrize("n", SIZES)
def test_piece_sums_of_a_buffer_filled_in_random_steps(n: int) -> None:
    payload = data(n, 3)

    async def receive() -> int:
        view = memoryview(bytearray(n))
        sums, filled, rng = PieceSums(view), 0, random.Random(n)
        while filled < n:
            step = min(n - filled, rng.choice([1, 4096, 65_536, PIECE_BYTES // 3, 2 * PIECE_BYTES]))
            view[filled:filled + step] = payload[filled:filled + step]
            filled += step
            sums.filled(filled)
        return await sums.result()

    assert asyncio.run(receive()) == zlib.crc32(payload)


def test_large_payloads_are_summed_on_the_sums_threads_small_ones_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, str]] = []
    real = checksum.zlib.crc32

    def counted(buffer: memoryview, *args: int) -> int:
        seen.append((len(buffer), threading.current_thread().name.split("_")[0]))
        return real(buffer, *args)

    monkeypatch.setattr(checksum.zlib, "crc32", counted)
    n = 3 * PIECE_BYTES + 5
    asyncio.run(checksum.crc32_threaded(memoryview(data(n))))
    size = whole_buffer_piece_bytes(n)
    assert sorted(seen) == sorted((end - start, "kv-sums") for start, end in pieces(n, size))
    assert len(seen) <= checksum.SUMS_THREADS or size == PIECE_BYTES
    seen.clear()
    asyncio.run(checksum.crc32_threaded(memoryview(data(16 * PIECE_BYTES))))  # a bf16 llama3-8b layer's 16 MiB
    assert len(seen) == max(1, min(16, checksum.SUMS_THREADS))
    seen.clear()
    asyncio.run(checksum.crc32_threaded(memoryview(data(1000))))
    assert seen == [(1000, "MainThread")]


def test_the_loop_waits_on_few_pieces_not_on_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piece's sum does not call back into the event loop: `result()` waits for the last piece sent and then
    only for pieces still running (fewer than the sums threads, as the pool starts pieces in order)."""
    waited = []
    real = checksum.asyncio.wrap_future

    def counted(future, **kwargs):  # type: ignore[no-untyped-def]
        waited.append(future)
        return real(future, **kwargs)

    monkeypatch.setattr(checksum.asyncio, "wrap_future", counted)
    payload = data(16 * PIECE_BYTES, 4)
    sums = PieceSums(memoryview(payload))
    assert asyncio.run(sums.result()) == zlib.crc32(payload)
    assert 1 <= len(waited) <= checksum.SUMS_THREADS


def test_staged_layers_wait_on_one_thread_in_order_then_sum_on_the_sums_threads() -> None:
    """P's staged layers (kv_transfer/staging.py): each host copy's event is waited for on the one "kv-staged"
    thread, in submission order (not one of asyncio's default threads per layer in flight), then the layer's CRC-32
    is summed in pieces. The events stand in for CUDA's (this host has none); only `synchronize` is called."""
    waits: list[tuple[int, str]] = []

    class Event:
        def __init__(self, layer: int) -> None:
            self.layer = layer

        def synchronize(self) -> None:
            waits.append((self.layer, threading.current_thread().name.split("_")[0]))

    layers = [torch.randint(0, 255, (2 * PIECE_BYTES + 3,), dtype=torch.uint8) for _ in range(4)]

    async def stage_all() -> list[int]:
        staged = [StagedBlocks(host, Event(i)) for i, host in enumerate(layers)]  # type: ignore[arg-type]
        return await asyncio.gather(*(s.checksum() for s in staged))

    assert asyncio.run(stage_all()) == [zlib.crc32(layer.numpy()) for layer in layers]
    assert waits == [(i, "kv-staged") for i in range(4)]
