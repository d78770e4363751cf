from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cache_store.hashing import (
    DIGEST_SIZE,
    block_hashes,
    hash_block,
    num_lookup_blocks,
    prefix_lookup,
)

FP = "smollm2-135m:bf16"


@pytest.mark.parametrize(("num_tokens", "num_full"), [(0, 0), (1, 0), (15, 0), (16, 1), (17, 1), (33, 2)])
def test_only_full_blocks_are_hashed(num_tokens: int, num_full: int) -> None:
    hashes = block_hashes(list(range(num_tokens)), 16, FP)
    assert len(hashes) == num_full
    assert all(isinstance(h, bytes) and len(h) == DIGEST_SIZE for h in hashes)


def test_hashes_chain_on_the_whole_prefix() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16, FP)
    b = block_hashes([9] * 16 + [2] * 16, 16, FP)
    assert a[0] != b[0]
    assert a[1] != b[1], "same second block under a different first block must hash differently"
    assert a[1] == hash_block([2] * 16, FP, parent=a[0])


def test_parent_continues_a_chain() -> None:
    tokens = list(range(64))
    whole = block_hashes(tokens, 16, FP)
    tail = block_hashes(tokens[32:], 16, FP, parent=whole[1])
    assert tail == whole[2:]


def test_salt_and_fingerprint_change_hashes() -> None:
    tokens = list(range(32))
    base = block_hashes(tokens, 16, FP)
    assert block_hashes(tokens, 16, FP) == base
    assert block_hashes(tokens, 16, FP, salt="tenant-a") != base
    assert block_hashes(tokens, 16, FP, salt="tenant-a") != block_hashes(tokens, 16, FP, salt="tenant-b")
    assert block_hashes(tokens, 16, FP, salt="") != base, "empty salt is still a salt"
    other = block_hashes(tokens, 16, "llama3-8b:bf16")
    assert all(x != y for x, y in zip(base, other))


def test_same_hashes_in_another_process() -> None:
    """Stable across processes (Python's hash() is salted per process; blake2b is not)."""
    code = (
        "from pdserve.cache_store.hashing import block_hashes;"
        f"print(','.join(h.hex() for h in block_hashes(list(range(40)), 16, {FP!r}, salt='s')))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ",".join(h.hex() for h in block_hashes(list(range(40)), 16, FP, salt="s"))


def test_known_digest_pins_the_encoding() -> None:
    """Changing the byte encoding silently would orphan every cached block in Redis: bump _PERSON instead."""
    assert block_hashes(list(range(16)), 16, "fp")[0].hex() == "db6770badd9a34d15c36388ad4e8ed51"


def test_hashing_does_not_import_torch() -> None:
    code = "import sys, pdserve.cache_store.hashing; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_bad_token_ids_are_rejected(bad: list) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_hashes(bad * 16, 16, FP)


def test_bad_parent_and_block_size() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        block_hashes([1] * 16, 16, FP, parent=b"short")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1] * 16, 0, FP)


@pytest.mark.parametrize(("num_tokens", "expected"), [(1, 0), (16, 0), (17, 1), (32, 1), (33, 2), (48, 2)])
def test_prefix_lookup_never_covers_the_last_token(num_tokens: int, expected: int) -> None:
    """Its logits give the first output token, so the block holding it is always computed."""
    hashes = block_hashes(list(range(num_tokens)), 16, "model")
    assert num_lookup_blocks(num_tokens, 16) == expected
    assert prefix_lookup(hashes, num_tokens, 16) == hashes[:expected]
