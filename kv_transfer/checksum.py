"""CRC-32 (zlib's) of a large payload, summed in pieces on several threads and combined: the same value as
`zlib.crc32(payload)`, so the wire (a kv frame's `checksum`) is unchanged.

zlib sums one buffer on one thread (~2.4-3.4 GB/s on the GPU hosts and the dev box). The tcp backend moved a
4,096-token Llama-3-8B KV (512 MiB bf16) at ~1.9 GB/s on an H100 host, and py-spy over both processes
(benchmarks/transfer_tcp_profile_h200.sh, results/transfer_tcp_profile_h100.json) put P's one sums thread at
~220 ms of each ~290 ms transfer, D's chained sums (each 2 MiB step waiting for the one before) at ~140 ms, and
D's event loop 1.1-1.5 ms a layer summing a payload's tail itself while that connection received nothing: each
layer landed ~2 ms later than its bytes alone would say, in both dtypes (fp8 0.62x of bf16's time, not 0.5x). Here a payload is cut
into pieces that `pieces()` names (the first takes the odd length, every other one is the piece size), each summed
on its own as soon as its bytes are there, and the sums are combined in order:

    crc32(A + B) = A's crc multiplied by x^(8 len(B)) mod P, xor B's crc         (GF(2), zlib's crc32_combine)

Multiplying by the one fixed power of x (every piece after the first has the same length) is linear over GF(2),
so it is four 256-entry tables, built once a piece size from 32 products: combining a piece costs four lookups.

On an H100 host (results/transfer_tcp_piece_sums_ab_h100.json, against one sums thread on P and chained sums on
D): fp8 204 / 214 -> 139 / 147 ms, bf16 355 / 386 -> 362 / 256 ms; fp8 0.55x of bf16's time. It cost P's compute
thread: its 32 layer submissions took 24-60 ms against 10-15, every line alike slower (py-spy), as a thread
waiting for the GIL does, which each piece took ~4 times (hand-off, return, the future's result, the loop's
wake-up). So the sums threads no longer call back into the event loop: a piece is a plain executor job, and
`result()` awaits the last one sent (the last to start; the others have mostly finished by then) and then any
still running, ~one wake-up a payload; and a whole buffer (P's, `crc32_threaded`) is cut into one piece per sums
thread (at least PIECE_BYTES, a power of two: few distinct combining tables), not into PIECE_BYTES pieces: 16 MiB
is four pieces, not sixteen. D keeps PIECE_BYTES pieces, so that all but the last are summed while the rest of its
payload arrives. On an H100 host against the callbacks (results/transfer_tcp_fewer_wakeups_ab_h100.json): P's
submissions bf16 31 / 32 -> 17 / 21 ms, fp8 31 / 38 -> 33 / 27; the transfer unchanged (fp8 0.53-0.57x of bf16).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import zlib
from collections.abc import Sequence

PIECE_BYTES = 1 << 20
INLINE_BYTES = 256 << 10  # smaller payloads are summed on the calling thread: below a thread's round trip
_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected: bit 31 is x^0
_ONE = 1 << 31  # the polynomial 1
# P's and D's sums, all payloads' pieces in submission order (FIFO: a layer's pieces before the next layer's)
SUMS_THREADS = min(4, os.cpu_count() or 1)
SUMS = concurrent.futures.ThreadPoolExecutor(max_workers=SUMS_THREADS, thread_name_prefix="kv-sums")


def multiply(a: int, b: int) -> int:
    """a * b mod P over GF(2), both bit-reflected (zlib's multmodp)."""
    product, mask = 0, _ONE
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.cache
def _x_to_2_to(k: int) -> int:
    """x^(2^k) mod P."""
    return _ONE >> 1 if k == 0 else multiply(_x_to_2_to(k - 1), _x_to_2_to(k - 1))


def shift_operator(nbytes: int) -> int:
    """x^(8 nbytes) mod P: what a CRC is multiplied by when nbytes more bytes follow its data."""
    power, bits, k = _ONE, 8 * nbytes, 0
    while bits:
        if bits & 1:
            power = multiply(_x_to_2_to(k), power)
        bits >>= 1
        k += 1
    return power


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32(a + b) from crc32(a), crc32(b) and len(b)."""
    return multiply(shift_operator(len_b), crc_a) ^ crc_b


@functools.cache  # one entry per piece size: PIECE_BYTES and whole_buffer_piece_bytes's powers of two
def _shift_tables(nbytes: int) -> tuple[tuple[int, ...], ...]:
    """Four byte tables of multiply(shift_operator(nbytes), v), one per byte of v (the product is linear in v)."""
    operator = shift_operator(nbytes)
    tables = []
    for byte in range(4):
        bits = [multiply(operator, 1 << (8 * byte + i)) for i in range(8)]
        table = [0] * 256
        for v in range(1, 256):
            low = v & -v
            table[v] = table[v ^ low] ^ bits[low.bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)


def combine_pieces(crcs: Sequence[int], piece_bytes: int = PIECE_BYTES) -> int:
    """The CRC-32 of pieces laid end to end, from theirs: the first of any length, the others piece_bytes."""
    if not crcs:
        return 0
    t0, t1, t2, t3 = _shift_tables(piece_bytes)
    crc = crcs[0]
    for piece in crcs[1:]:
        crc = t0[crc & 0xFF] ^ t1[(crc >> 8) & 0xFF] ^ t2[(crc >> 16) & 0xFF] ^ t3[crc >> 24] ^ piece
    return crc


def pieces(nbytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """(start, end) of each piece of an nbytes payload: the first nbytes % piece_bytes (a whole piece when that
    is 0), then whole pieces. An empty payload is one empty piece."""
    first = nbytes % piece_bytes or min(nbytes, piece_bytes)
    return [(0, first)] + [(start, start + piece_bytes) for start in range(first, nbytes, piece_bytes)]


def whole_buffer_piece_bytes(nbytes: int) -> int:
    """The piece size for a buffer whose bytes are all there: one piece per sums thread, at least PIECE_BYTES,
    a power of two (so few sizes, each with its combining tables, occur)."""
    share = -(-nbytes // SUMS_THREADS)
    return max(PIECE_BYTES, 1 << (share - 1).bit_length())


class PieceSums:
    """The CRC-32 of a buffer that fills from the front (a payload being received): `filled(n)` as bytes land
    sends every piece now complete to the sums' threads, `result()` waits for them and combines."""

    def __init__(self, view: memoryview, piece_bytes: int = PIECE_BYTES) -> None:
        self.view = view
        self.piece_bytes = piece_bytes
        self._pieces = pieces(view.nbytes, piece_bytes)
        self._sent = 0
        self._sums: list[concurrent.futures.Future[int]] = []

    def filled(self, nbytes: int) -> None:
        """The buffer's first nbytes are final."""
        if self.view.nbytes < INLINE_BYTES:
            return
        while self._sent < len(self._pieces) and self._pieces[self._sent][1] <= nbytes:
            start, end = self._pieces[self._sent]
            self._sums.append(SUMS.submit(zlib.crc32, self.view[start:end]))
            self._sent += 1

    async def result(self) -> int:
        """The whole buffer's CRC-32 (every byte must have been `filled`). The loop wakes for the last piece sent
        and then only for those still running: no callback into the loop per piece."""
        if self.view.nbytes < INLINE_BYTES:
            return zlib.crc32(self.view)
        self.filled(self.view.nbytes)
        for future in reversed(self._sums):
            if not future.done():
                await asyncio.wrap_future(future)
        return combine_pieces([future.result() for future in self._sums], self.piece_bytes)

    def cancel(self) -> None:
        """Drop the sums not started yet (a failed read: the buffer is not used)."""
        for future in self._sums:
            future.cancel()


async def crc32_threaded(view: memoryview) -> int:
    """The CRC-32 of a whole buffer, in one piece per sums thread summed in parallel."""
    return await PieceSums(view, whole_buffer_piece_bytes(view.nbytes)).result()
