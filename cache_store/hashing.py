"""Chained prefix hashes of full KV blocks, identical in every process.

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]        block_size 16, 41 tokens
    hashes:  h0 = H(root, t0..t15)                       only the 2 full blocks are hashed;
             h1 = H(h0,   t16..t31)                      the partial tail block never is

H is BLAKE2b with a 16-byte digest over a canonical byte encoding of (parent hash, model fingerprint, salt,
token ids). Since h1 depends on h0, equal hashes mean equal whole prefixes, not just equal blocks. The digest
is the same in every process and on every machine (unlike Python's salted `hash()`), so the router, prefill
and decode workers and the Redis tier all agree on a block's name.

This module must stay free of torch: the router imports it to score prefill workers by cached prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 16
_PERSON = b"pdserve.kvblk.v1"  # blake2b personalization (16 bytes max): versions the encoding
_MAX_TOKEN_ID = 2**32 - 1


def prefix_lookup(hashes: Sequence[bytes], num_prompt_tokens: int, block_size: int) -> list[bytes]:
    """The hashes a prompt looks up in a prefix cache: its full blocks but the one holding its last token, whose
    logits give the first output token, so that token is always computed.

        prompt of 33 tokens, block_size 16:  [ h0 ][ h1 ][t32]    lookup = [h0, h1]  ((33 - 1) // 16 = 2)
        prompt of 32 tokens:                  [ h0 ][ h1 ]         lookup = [h0]      (t31 must be computed)
    """
    return list(hashes[: num_lookup_blocks(num_prompt_tokens, block_size)])


def num_lookup_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt a prefix cache may give (`prefix_lookup`'s length for a prompt
    whose full blocks are all hashed; the planner's simulator, which has no hashes, counts with it)."""
    return (num_prompt_tokens - 1) // block_size


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    salt: str | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`, chained from `parent` (None: the sequence starts here).

    `model_fingerprint` names everything that changes KV values for the same tokens (weights, dtype,
    rope scaling...): a worker passes its KV compatibility key (engine/kv_cache_spec.py), which for an fp8 cache
    also names the KV dtype and the per-layer scales, so fp8 and bf16 blocks never share a hash;
    `salt` separates tenants that must not share cache entries.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if parent is not None and len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent hash must be {DIGEST_SIZE} bytes, got {len(parent)}")
    base = _base_hasher(model_fingerprint, salt)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _hash_block(base, parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def hash_block(
    token_ids: Sequence[int], model_fingerprint: str, salt: str | None = None, parent: bytes | None = None
) -> bytes:
    """Hash of one block (any length) under `parent`; `block_hashes` is this applied block after block."""
    return _hash_block(_base_hasher(model_fingerprint, salt), parent, token_ids)


def _base_hasher(model_fingerprint: str, salt: str | None) -> hashlib.blake2b:
    """Hasher primed with the parts shared by every block of a sequence; copied once per block."""
    base = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_PERSON)
    base.update(_length_prefixed(model_fingerprint.encode()))
    if salt is None:
        base.update(b"\x00")
    else:
        base.update(b"\x01" + _length_prefixed(salt.encode()))
    return base


def _hash_block(base: hashlib.blake2b, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    hasher = base.copy()
    hasher.update(b"\x00" if parent is None else b"\x01" + parent)
    hasher.update(_encode_tokens(token_ids))
    return hasher.digest()


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Count then little-endian uint32 ids: no two different id lists share an encoding."""
    try:
        return struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
    except struct.error as exc:
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID]
        raise ValueError(f"token ids must be ints in [0, {_MAX_TOKEN_ID}], got {bad[:5]}") from exc
