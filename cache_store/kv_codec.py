"""One KV block as a self-describing value (host and Redis tiers), and moving blocks to and from the pool.

A block holds every layer's keys and values for `block_size` tokens, in the order the pool stores them:

    block  [num_layers, 2, block_size, num_kv_heads, head_dim]      (2: keys, values)
    pool   per layer [2, num_blocks, block_size, num_kv_heads, head_dim]

A stored value is a msgpack map followed by the raw bytes of one block, C order:

    ┌─────────────────────────────────────────────────────────────────┬─────────────────────────┐
    │ msgpack {v, fp, hash, dtype, shape, layers, nbytes, checksum}   │ nbytes raw bytes         │
    └─────────────────────────────────────────────────────────────────┴─────────────────────────┘

`decode_block` trusts nothing: it reads at most 4 KiB of header with msgpack's size limits, checks the
format version, the model fingerprint, the block hash, dtype, shape and layer count against what this worker
expects, that nbytes equals shape × itemsize and the bytes that follow, and the CRC-32, before copying a
single byte into the caller's (pre-sized) tensor. Any mismatch raises `CorruptValueError`: a miss, never
wrong KV. msgpack only, never pickle.
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from pdserve.kernels.block_copy import gather_blocks, scatter_blocks
from pdserve.kernels.host_copy import to_device

FORMAT_VERSION = 1
MAX_HEADER_BYTES = 4096

# Names in stored headers and on the KV wire (kv_transfer/wire.py) → dtypes. A dict, never getattr(torch, name):
# names come from outside.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CorruptValueError(ValueError):
    """A stored value that is not a block this worker can use (damaged, foreign or outdated)."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block of one worker's pool looks like; part of what a stored value must match."""

    model_fingerprint: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"KV dtype {self.dtype} cannot be stored; supported: {sorted(DTYPES)}")
        dims = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
        if min(dims) <= 0:
            raise ValueError(f"block layout needs positive sizes, got layers/block/heads/dim {dims}")

    @classmethod
    def of_pool(cls, kv_caches: list[torch.Tensor], model_fingerprint: str) -> BlockLayout:
        """From the pool's per-layer tensors [2, num_blocks, block_size, Hkv, D]."""
        if not kv_caches:
            raise ValueError("a KV pool needs at least one layer")
        two, _, block_size, heads, dim = kv_caches[0].shape
        if two != 2:
            raise ValueError(f"KV pool layers must be [2, blocks, block_size, Hkv, D], got {tuple(kv_caches[0].shape)}")
        return cls(model_fingerprint, len(kv_caches), block_size, heads, dim, kv_caches[0].dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return int(torch.empty(0, dtype=self.dtype).element_size())

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def empty(self, num_blocks: int, pin_memory: bool = False) -> torch.Tensor:
        """Host staging for `num_blocks` blocks: [n, layers, 2, block_size, Hkv, D]."""
        return torch.empty((num_blocks, *self.shape), dtype=self.dtype, pin_memory=pin_memory)


def _raw(block: torch.Tensor) -> memoryview:
    return memoryview(block.contiguous().reshape(-1).view(torch.uint8).numpy())


def encode_block(layout: BlockLayout, block_hash: bytes, block: torch.Tensor) -> bytes:
    """block: [layers, 2, block_size, Hkv, D] on the CPU → header + raw bytes."""
    return b"".join(encode_block_parts(layout, block_hash, block))


def encode_block_parts(layout: BlockLayout, block_hash: bytes, block: torch.Tensor) -> tuple[bytes, memoryview]:
    """The header and the raw bytes of `encode_block`'s value, not yet joined (the Redis tier seals both, then
    joins them with the seal in one copy)."""
    if tuple(block.shape) != layout.shape or block.dtype != layout.dtype:
        raise ValueError(f"block {tuple(block.shape)} {block.dtype} does not match layout {layout.shape} {layout.dtype}")
    raw = _raw(block)
    header = {
        "v": FORMAT_VERSION, "fp": layout.model_fingerprint, "hash": block_hash,
        "dtype": DTYPE_NAMES[layout.dtype], "shape": list(layout.shape), "layers": layout.num_layers,
        "nbytes": raw.nbytes, "checksum": zlib.crc32(raw),
    }
    return msgpack.packb(header, use_bin_type=True), raw


def _read_header(value: bytes | memoryview) -> tuple[dict[str, Any], int]:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_HEADER_BYTES, max_str_len=512, max_bin_len=64,
                                max_array_len=8, max_map_len=16, strict_map_key=True)
    unpacker.feed(value[:MAX_HEADER_BYTES])
    try:
        header = unpacker.unpack()
    except (msgpack.OutOfData, ValueError, TypeError) as exc:  # msgpack's format errors are ValueErrors
        raise CorruptValueError(f"unreadable header ({len(value)} bytes): {exc!r}") from None
    if not isinstance(header, dict):
        raise CorruptValueError(f"header is a {type(header).__name__}, not a map")
    return header, unpacker.tell()


def _check_header(layout: BlockLayout, block_hash: bytes, header: dict[str, Any]) -> None:
    version = header.get("v")
    if version != FORMAT_VERSION:
        raise CorruptValueError(f"format version {version!r}, this worker reads {FORMAT_VERSION}")
    if header.get("fp") != layout.model_fingerprint:
        raise CorruptValueError(f"model fingerprint {header.get('fp')!r} is not ours ({layout.model_fingerprint!r})")
    if header.get("hash") != block_hash:
        raise CorruptValueError("value stored under another block's key")
    if header.get("dtype") != DTYPE_NAMES[layout.dtype]:
        raise CorruptValueError(f"dtype {header.get('dtype')!r}, pool holds {DTYPE_NAMES[layout.dtype]}")
    if header.get("shape") != list(layout.shape) or header.get("layers") != layout.num_layers:
        raise CorruptValueError(f"shape {header.get('shape')!r} / layers {header.get('layers')!r}, "
                                f"expected {list(layout.shape)} / {layout.num_layers}")
    if header.get("nbytes") != layout.nbytes:
        raise CorruptValueError(f"header declares {header.get('nbytes')!r} bytes, shape × itemsize is {layout.nbytes}")
    if not isinstance(header.get("checksum"), int):
        raise CorruptValueError(f"checksum {header.get('checksum')!r} is not an integer")


def decode_block(layout: BlockLayout, block_hash: bytes, value: bytes | memoryview, out: torch.Tensor) -> None:
    """Check `value` completely, then copy its block into `out` ([layers, 2, block_size, Hkv, D], CPU)."""
    header, offset = _read_header(value)
    _check_header(layout, block_hash, header)
    payload = memoryview(value)[offset:]
    if payload.nbytes != layout.nbytes:
        raise CorruptValueError(f"{payload.nbytes} payload bytes, header declares {layout.nbytes}")
    if zlib.crc32(payload) != header["checksum"]:
        raise CorruptValueError("checksum mismatch")
    with warnings.catch_warnings():  # read-only source buffer: only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(payload, dtype=torch.uint8)
    out.reshape(-1).view(torch.uint8).copy_(source)


# ---- pool <-> host staging --------------------------------------------------------------------------------

def gather_to_host(kv_caches: list[torch.Tensor], block_ids: list[int], out: torch.Tensor) -> torch.cuda.Event | None:
    """Copy pool blocks into `out` [n, layers, 2, block_size, Hkv, D] (CPU, pinned when the pool is on CUDA).

    On CUDA the copy is queued on the current stream and an event is returned: read `out` only after
    `event.synchronize()`. Later kernels on the stream (a forward that reuses the blocks) run after it.
    """
    device = kv_caches[0].device
    ids = to_device(block_ids, torch.int64, device)  # not waiting for the step in flight
    per_layer = torch.stack([gather_blocks(kv, ids) for kv in kv_caches])  # [L, 2, n, bs, Hkv, D]
    packed = per_layer.permute(2, 0, 1, 3, 4, 5)  # [n, L, 2, bs, Hkv, D]
    if device.type != "cuda":
        out.copy_(packed)
        return None
    out.copy_(packed.contiguous(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event


def scatter_from_host(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: torch.Tensor) -> None:
    """Write `blocks` [n, layers, 2, block_size, Hkv, D] (CPU) into pool blocks `block_ids`."""
    device = kv_caches[0].device
    ids = to_device(block_ids, torch.int64, device)  # not waiting for the step in flight
    staged = blocks.to(device, non_blocking=True)
    for layer, kv in enumerate(kv_caches):
        scatter_blocks(kv, ids, staged[:, layer].transpose(0, 1))  # [2, n, bs, Hkv, D]
