"""What sealing Redis values costs (cache_store/redis_auth.py): HMAC-SHA256 over a block's bytes, beside keyed
BLAKE2b and the CRC-32 that kv_codec computes anyway, one thread, for the block sizes of redis_granularity.py.

    .venv/bin/python benchmarks/redis_seal.py
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
import zlib
from collections.abc import Callable

from pdserve.cache_store.redis_auth import RedisAuth

BLOCK_BYTES = {"64KiB": 64 << 10, "smollm2_bf16_360KiB": 368_640, "llama3_8b_bf16_2MiB": 2 << 20}
KEY = b"k" * 32


def per_call_s(fn: Callable[[], object], repeats: int = 50) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def cases(auth: RedisAuth, key: str, data: bytes) -> dict[str, Callable[[], object]]:
    sealed = data + auth.seal(key, data)
    return {"RedisAuth.seal": lambda: auth.seal(key, data), "RedisAuth.open": lambda: auth.open(key, sealed),
            "hmac-sha256": lambda: hmac.digest(KEY, data, "sha256"),
            "blake2b keyed": lambda: hashlib.blake2b(data, key=KEY, digest_size=32).digest(),
            "crc32": lambda: zlib.crc32(data)}


def main() -> None:
    auth = RedisAuth("benchmark-secret", "model-fingerprint", 16)
    key = auth.key(b"\x00" * 16, None)
    for name, size in BLOCK_BYTES.items():
        for case, fn in cases(auth, key, os.urandom(size)).items():
            seconds = per_call_s(fn)
            print(f"{name:22s} {case:15s} {seconds * 1e3:7.3f} ms  {size / seconds / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
