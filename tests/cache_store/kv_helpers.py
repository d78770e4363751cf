"""Helpers for the cache_store tests: small KV pools with known contents and one worker's cache pieces."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import msgpack
import torch

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.hashing import prefix_lookup
from pdserve.cache_store.kv_codec import FORMAT_VERSION, BlockLayout, encode_block
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache

LAYERS, BS, HEADS, DIM = 3, 4, 2, 8
FP = "test-model:fp32"
SECRET = "cache-test-secret"  # the deployment's shared secret: names and seals Redis values
NUM_BLOCKS = 16


def layout(dtype: torch.dtype = torch.float32, fingerprint: str = FP) -> BlockLayout:
    return BlockLayout(fingerprint, LAYERS, BS, HEADS, DIM, dtype)


def random_blocks(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """[n, layers, 2, BS, HEADS, DIM] of distinct values (exact in every dtype's round trip)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((n, LAYERS, 2, BS, HEADS, DIM), generator=generator).to(dtype)


@dataclass
class Worker:
    """One worker's pool, prefix cache and tiered cache (the pieces a node holds)."""

    pool: BlockPool
    prefix_cache: PrefixCache
    kv_caches: list[torch.Tensor]
    cache: TieredKVCache

    def write(self, block_ids: tuple[int, ...] | list[int], seed: int) -> torch.Tensor:
        """'Compute' KV into blocks: random values; returns them as [n, layers, 2, BS, HEADS, DIM]."""
        blocks = random_blocks(len(block_ids), self.kv_caches[0].dtype, seed)
        for layer, kv in enumerate(self.kv_caches):
            kv[:, list(block_ids)] = blocks[:, layer].transpose(0, 1).to(kv.device)
        return blocks

    def read(self, block_ids: tuple[int, ...] | list[int]) -> torch.Tensor:
        """KV of blocks, on the CPU: [n, layers, 2, BS, HEADS, DIM]."""
        return torch.stack([kv[:, list(block_ids)] for kv in self.kv_caches]).permute(2, 0, 1, 3, 4, 5).cpu()


CORRUPTIONS = ("bad checksum", "truncated", "extra bytes", "wrong shape", "nbytes lies", "another model",
               "format version", "another block", "wrong dtype", "not msgpack", "header only", "not a map", "empty")


def _value(lay: BlockLayout, block: torch.Tensor, block_hash: bytes, **header: object) -> bytes:
    raw = block.contiguous().view(torch.uint8).numpy().tobytes()
    fields = {"v": FORMAT_VERSION, "fp": lay.model_fingerprint, "hash": block_hash, "dtype": "float32",
              "shape": list(block.shape), "layers": block.shape[0], "nbytes": len(raw), "checksum": zlib.crc32(raw)}
    fields.update(header)
    return msgpack.packb(fields, use_bin_type=True) + raw


def corrupt_value(lay: BlockLayout, block: torch.Tensor, block_hash: bytes, kind: str) -> bytes:
    """A stored value for `block` (fp32) damaged in one way; `kind` is one of CORRUPTIONS."""
    good = encode_block(lay, block_hash, block)
    if kind == "bad checksum":
        flipped = bytearray(good)
        flipped[-5] ^= 0xFF
        return bytes(flipped)
    values = {
        "truncated": lambda: good[:-7],
        "extra bytes": lambda: good + b"\x00",
        "wrong shape": lambda: _value(lay, block[:2], block_hash),
        "nbytes lies": lambda: _value(lay, block, block_hash, nbytes=10**12),
        "another model": lambda: _value(lay, block, block_hash, fp="other-model:fp32"),
        "format version": lambda: _value(lay, block, block_hash, v=FORMAT_VERSION + 1),
        "another block": lambda: _value(lay, block, b"\x01" * 16),
        "wrong dtype": lambda: _value(lay, block, block_hash, dtype="float16"),
        "not msgpack": lambda: b"\xc1" * 64,
        "header only": lambda: msgpack.packb({"v": FORMAT_VERSION}),
        "not a map": lambda: msgpack.packb([1, 2, 3]) + b"x" * 10,
        "empty": lambda: b"",
    }
    return values[kind]()


PROMPT = list(range(100, 125))  # 25 tokens: 6 full blocks, the lookup covers (25 - 1) // 4 = 6


def host_gb(blocks: int) -> float:
    return blocks * layout().nbytes / (1 << 30)


def prefill(worker: Worker, prompt: list[int], salt: str | None = None, seed: int = 0,
            timeout_s: float | None = None) -> tuple[int, torch.Tensor]:
    """What a prefill node does: fetch, allocate (+load), compute the rest, commit, free.

    Returns the number of cached tokens and the prompt's full blocks' KV as computed or loaded.
    """
    cache = worker.cache
    hashes = cache.sequence_hashes(prompt, salt)
    lookup = prefix_lookup(hashes, len(prompt), BS)
    fetched = cache.fetch(lookup, salt, timeout_s)
    seq = cache.allocate(lookup, blocks_needed(len(prompt), BS), fetched)
    fresh = seq.block_ids[seq.num_cached_blocks:]
    if fresh:
        worker.write(fresh, seed)
    kv = worker.read(seq.block_ids[:len(hashes)])
    cache.commit(hashes, seq.block_ids, seq.num_cached_blocks, salt)
    worker.pool.free(seq.block_ids)
    return seq.num_cached_tokens, kv


def drop_device(worker: Worker) -> None:
    worker.pool.evict_all_cached()
