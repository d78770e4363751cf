"""What a `store` transfer leaves in the shared store, named and sealed as the Redis tier's blocks are.

    chunk value   key  pdserve:xfer:{ns}:{digest of token, part}          (cache_store/redis_auth.py)
                  raw blocks [2, n, block_size, Hkv, D] in C order ‖ HMAC-SHA256(seal key, key ‖ raw)
    record        kv_stored / done / error / lost (kv_transfer/wire.py headers, msgpack)
                  ‖ HMAC-SHA256(seal key, inbox key ‖ msgpack)            pushed to the decode worker's inbox

The keys come from the deployment's secret (PDSERVE_SECRET), the model fingerprint and block size, the
decode worker's random token for the reservation and the chunk's number: unguessable without the target, and
never a name the prefix tiers use. A record is checked in this order: its size (MAX_RECORD_BYTES), its seal,
then `decode_header`'s exact types; a chunk's value: its size (the record's stored_nbytes + 32, before it is
read), its seal, then the record's CRC-32 — what the tcp receiver checks of a kv frame, and the Redis tier of
a block. A failure is never KV: the request fails (and is recomputed, per --kv-load-failure-policy).
"""

from __future__ import annotations

from pdserve.cache_store.redis_auth import SEAL_BYTES, ForgedValueError, RedisAuth
from pdserve.cache_store.shared_store import MAX_RECORD_BYTES
from pdserve.kv_transfer.wire import Header, ProtocolError, decode_header, pack_header


class TransferSeal:
    """Names and seals of the values and records of transfers with one block size."""

    def __init__(self, secret: str | None, model_fingerprint: str, block_size: int) -> None:
        self.auth = RedisAuth(secret, model_fingerprint, block_size)

    def chunk_key(self, token: str, part: int) -> str:
        return self.auth.transfer_key(token, f"chunk{part}")

    def inbox_key(self, inbox: str) -> str:
        return self.auth.inbox_key(inbox)

    def seal_record(self, inbox_key: str, header: Header) -> bytes:
        packed = pack_header(header)
        return packed + self.auth.seal(inbox_key, packed)

    def open_record(self, inbox_key: str, record: bytes | bytearray) -> Header:
        """The header inside a record pushed to `inbox_key`; ProtocolError when its size, seal or fields fail."""
        if len(record) > MAX_RECORD_BYTES:
            raise ProtocolError(f"a {len(record)}-byte record exceeds the {MAX_RECORD_BYTES}-byte limit")
        try:
            body = self.auth.open(inbox_key, bytes(record))
        except ForgedValueError as exc:
            raise ProtocolError(f"record refused: {exc}") from None
        return decode_header(bytes(body))

    def value_seal(self, key: str, payload: memoryview | bytes) -> bytes:
        return self.auth.seal(key, payload)

    def open_value(self, key: str, value: bytes | bytearray) -> memoryview:
        """The raw blocks inside a chunk's value (ForgedValueError when the seal fails)."""
        return self.auth.open(key, value)


def stored_size(payload_nbytes: int) -> int:
    """Bytes of a chunk's value in the store: the blocks and their seal."""
    return payload_nbytes + SEAL_BYTES


def chunk_bounds(num_blocks: int, block_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) block ranges of one layer's send, each at most `chunk_bytes` (at least one block)."""
    per_chunk = max(1, chunk_bytes // block_bytes)
    return [(lo, min(lo + per_chunk, num_blocks)) for lo in range(0, num_blocks, per_chunk)]
