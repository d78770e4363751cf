"""What the Redis tier writes is named and sealed with keys derived from the deployment's shared secret
(PDSERVE_SECRET, passed down as config), and nothing it reads is used before the seal is checked.

    name key, seal key   = HMAC-SHA256(secret, "pdserve.redis.names.v1" / "pdserve.redis.seal.v1")
    key                  pdserve:{namespace}:{block id}
        namespace        hex(HMAC(name key, fingerprint ‖ block size)[:8])    one per model and block size
        block id         hex(HMAC(name key, namespace ‖ salt ‖ block hash)[:16])
    value                kv_codec value ‖ HMAC-SHA256(seal key, len(key) ‖ key ‖ kv_codec value)   (32 bytes)

The `store` KV transfer (kv_transfer/store/) names and seals with the same keys, under its own prefix, so its
values never share a name with a cached block's:

    chunk / record key   pdserve:xfer:{namespace}:{hex(HMAC(name key, "xfer" ‖ namespace ‖ token ‖ part)[:16])}
    inbox key            pdserve:xfer:{namespace}:inbox:{hex(HMAC(name key, "inbox" ‖ namespace ‖ inbox)[:16])}
        token            random per reservation (the decode worker's TransferTarget), part: a chunk's number

The fingerprint and the cache salt are never in clear, and without the secret nobody can compute a block's
key from guessed tokens (the block hash itself is public: cache_store/hashing.py), so reading Redis does not
tell whether someone sent a given prompt. A value whose seal fails (forged, damaged, or moved to another key)
is a miss, counted as `redis_auth_failures`; a value written with another secret sits under another key and
is never read. An operator drops one model's blocks with `SCAN MATCH pdserve:{namespace}:*` (the namespace is
in the worker's /internal/cache); per-salt deletion would need the secret.

What the seal does not stop (docs/reliability.md, "The Redis tier"): replaying an older value that was valid
under the same key (the same block of the same prefix, so the same KV: harmless unless the model changed
without its fingerprint), deleting or evicting values (a miss: recompute), and reading the KV bytes (values
are not encrypted: whoever reads Redis reads the KV, from which prompt text can be partly recovered).

Without a secret (a worker started without PDSERVE_SECRET) the keys are derived from an empty one: names and
seals still detect damage, but anyone can compute them; the worker warns once at start.

HMAC-SHA256 runs at 1.3-1.4 GB/s on one core of the 2-core development machine (SHA-NI; keyed BLAKE2b 0.5-0.8,
the CRC-32 kv_codec computes anyway 2.4-4.4, depending on the machine's load): 0.28 ms for a 360 KiB SmolLM2
block, 1.6 ms for a 2 MiB Llama-3-8B block, against 3.4 ms to GET that from a loopback Redis (redis_tier.py's
table); hashlib releases the GIL, so the I/O threads seal and check in parallel
(`python benchmarks/redis_seal.py`).
"""

from __future__ import annotations

import hmac
import struct

SEAL_BYTES = 32
_NAMES_LABEL = b"pdserve.redis.names.v1"
_SEAL_LABEL = b"pdserve.redis.seal.v1"


class ForgedValueError(ValueError):
    """A Redis value whose seal does not match its key and bytes."""


class RedisAuth:
    def __init__(self, secret: str | None, model_fingerprint: str, block_size: int) -> None:
        raw = (secret or "").encode()
        self.authenticated = bool(secret)
        self._name_key = hmac.digest(raw, _NAMES_LABEL, "sha256")
        self._seal_key = hmac.digest(raw, _SEAL_LABEL, "sha256")
        scope = _length_prefixed(model_fingerprint.encode()) + struct.pack("<I", block_size)
        self.namespace = hmac.digest(self._name_key, b"ns" + scope, "sha256")[:8].hex()
        self._prefix = f"pdserve:{self.namespace}:"

    def key(self, block_hash: bytes, salt: str | None) -> str:
        salted = b"\x00" if salt is None else b"\x01" + _length_prefixed(salt.encode())
        digest = hmac.digest(self._name_key, self.namespace.encode() + salted + block_hash, "sha256")
        return self._prefix + digest[:16].hex()

    def transfer_key(self, token: str, part: str) -> str:
        """The name of one value of a `store` transfer: `token` is the reservation's, `part` names the value."""
        scope = self.namespace.encode() + _length_prefixed(token.encode()) + part.encode()
        return f"pdserve:xfer:{self.namespace}:{hmac.digest(self._name_key, b'xfer' + scope, 'sha256')[:16].hex()}"

    def inbox_key(self, inbox: str) -> str:
        """The name of a decode worker's inbox of transfer records (a Redis list, or the shm store's socket)."""
        digest = hmac.digest(self._name_key, b"inbox" + self.namespace.encode() + inbox.encode(), "sha256")
        return f"pdserve:xfer:{self.namespace}:inbox:{digest[:16].hex()}"

    def seal(self, key: str, *parts: bytes | memoryview) -> bytes:
        """The seal of a value made of `parts` (the kv_codec header and raw bytes), to append to it."""
        mac = hmac.new(self._seal_key, _length_prefixed(key.encode()), "sha256")
        for part in parts:
            mac.update(part)
        return mac.digest()

    def open(self, key: str, value: bytes | bytearray) -> memoryview:
        """The kv_codec value inside a stored one, once its seal is checked (else ForgedValueError)."""
        if len(value) < SEAL_BYTES:
            raise ForgedValueError(f"a {len(value)}-byte value holds no seal")
        view = memoryview(value)
        body, tag = view[:-SEAL_BYTES], view[-SEAL_BYTES:]
        if not hmac.compare_digest(self.seal(key, body), tag):
            raise ForgedValueError(f"the seal of {key} does not match (forged, damaged, or another key's value)")
        return body


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data
