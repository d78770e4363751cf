"""Compact summaries of the prefix blocks a worker holds, for the router's cache-aware prefill policy.

    worker   cache_store/summary.py's RecentHashes: the chained hashes committed or hit lately
             → the ones still on the device or in host RAM → encode_summary → heartbeat `cached_blocks`
    router   decode_summary → a set of keys per worker; matched_blocks(prompt hashes, keys) = the length of the
             prompt's cached prefix there

A key is the first 8 bytes of a block hash: 4,096 keys are 32 KiB (44 KiB as base64 in JSON), and two of a
worker's blocks share a key with probability ~n²/2⁶⁵ (nil in practice; a collision only misroutes, it never
changes a result: the worker looks up full hashes). Only full-block hashes are ever compared, as in the tiers.

Torch-free, like all of protocol/: the router imports it.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Iterable, Sequence

KEY_BYTES = 8
DEFAULT_SUMMARY_BLOCKS = 4096


def summary_key(block_hash: bytes) -> bytes:
    return block_hash[:KEY_BYTES]


def encode_summary(hashes: Iterable[bytes]) -> str:
    """Block hashes → base64 of their concatenated keys (the heartbeat's `cached_blocks`)."""
    return base64.b64encode(b"".join(summary_key(h) for h in hashes)).decode("ascii")


def decode_summary(text: str) -> frozenset[bytes]:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % KEY_BYTES:
        raise ValueError(f"a block summary holds {KEY_BYTES}-byte keys; got {len(raw)} bytes")
    return frozenset(raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))


def matched_blocks(hashes: Sequence[bytes], keys: Collection[bytes]) -> int:
    """How many leading `hashes` the summary `keys` holds (the chain stops at the first miss)."""
    count = 0
    for block_hash in hashes:
        if summary_key(block_hash) not in keys:
            break
        count += 1
    return count

