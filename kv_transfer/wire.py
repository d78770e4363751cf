"""KV wire format: length-prefixed msgpack headers followed by raw tensor bytes. Never pickle.

One frame:

    ┌──────────────┬───────────────────────────────┬──────────────────────────────┐
    │ u32 BE: H    │ H bytes: msgpack map header   │ header["nbytes"] raw bytes   │
    └──────────────┴───────────────────────────────┴──────────────────────────────┘

Every header holds `version`, `kind` and `nbytes` (0 except for "kv"). Kinds, in the order a connection
sees them:

    hello  receiver → sender   {nonce}                          first frame on every connection
    auth   sender → receiver   {mac}                            HMAC-SHA256(secret, nonce), None without secret
    ready  receiver → sender   {}                               accepted (else an error frame, then close)
    pools  receiver → sender   {descriptor}                     cuda_ipc only, right after ready: D's pool
                               handles, msgpack bytes of kv_transfer/cuda_ipc/descriptor.PoolDescriptor
    rendezvous receiver → sender {backend, store_host, store_port, key, timeout_ms}
                               nccl only, right after ready: where both join this connection's two-rank
                               torch.distributed group (D rank 0, P rank 1; backend "nccl" or "gloo")
    kv     sender → receiver   {request_id, layer, block_ids, dtype, shape, nbytes, checksum}
                               payload = blocks [2, len(block_ids), block_size, Hkv, D] in C order,
                               block_ids are the RECEIVER's destination blocks, checksum = zlib.crc32
    kv_bulk sender → receiver  {request_id, layer, block_ids, dtype, shape, bulk_nbytes}
                               nccl only: as kv, but the payload follows through the group (a send of
                               bulk_nbytes to rank 0), not the socket; nbytes is 0
    done   sender → receiver   {request_id, first_token_id, first_logprob, num_tokens, top_token_ids, top_logprobs}
                               the first token (sampled on P), its logprob and P's top-k alternatives, so that
                               D's first delta carries what P's PREFILLED does (the top lists may be absent: [])
    error  sender → receiver   {request_id, reason}              the sender gave the request up
           receiver → sender   {request_id: "", reason}          handshake refused (bad secret, version)

The `store` backend (kv_transfer/store/) sends no frames on a socket of its own: its records are these headers,
msgpack without the length prefix, each sealed, pushed to the decode worker's inbox in the shared store:

    kv_stored sender → inbox   {request_id, layer, block_ids, dtype, shape, stored_nbytes, checksum, part}
                               as kv, but the payload waits in the store under the key of `part` (nbytes 0)
    done, error                as above
    lost   receiver → own inbox {request_id, reason}             the router saw the sender go: every record it
                               pushed before is ahead of this one

After the handshake the receiver never writes: a sender learns of a dropped connection from its next
write, and the decode node learns of every failure through its receiver's on_failure.

A reader checks the header length, then the header's fields and types, and only then reads (and
allocates) the payload: a frame that claims 10 GB is refused after reading at most 4 + 64 KiB bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
import zlib
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from types import NoneType
from typing import Any, ClassVar

import msgpack
import torch

# dtype names as the cache store writes them (a table, never getattr(torch, name): names come from the network)
from pdserve.cache_store.kv_codec import DTYPE_NAMES, DTYPES
from pdserve.kv_transfer.checksum import PieceSums
from pdserve.kv_transfer.payload_reader import PayloadReader

WIRE_VERSION = 1
_LENGTH = struct.Struct(">I")
_AUTH_CONTEXT = b"pdserve-kv-auth-v1"


class ProtocolError(Exception):
    """The peer broke the protocol (or timed out mid-frame): drop the connection."""


@dataclass(frozen=True)
class FrameLimits:
    """What a reader accepts before it allocates anything."""

    max_header_bytes: int = 64 * 1024
    max_payload_bytes: int = 1 << 30
    read_timeout_s: float = 10.0  # for each read inside a frame, once its first byte arrived
    idle_timeout_s: float | None = None  # between frames; None: connections are reused, wait forever

    def __post_init__(self) -> None:
        if self.max_header_bytes <= 0 or self.max_payload_bytes <= 0 or self.read_timeout_s <= 0:
            raise ValueError(f"FrameLimits must be positive: {self}")


@dataclass(frozen=True)
class Hello:
    KIND: ClassVar[str] = "hello"
    nonce: bytes


@dataclass(frozen=True)
class Auth:
    KIND: ClassVar[str] = "auth"
    mac: bytes | None


@dataclass(frozen=True)
class Ready:
    KIND: ClassVar[str] = "ready"


@dataclass(frozen=True)
class Pools:
    KIND: ClassVar[str] = "pools"
    descriptor: bytes


@dataclass(frozen=True)
class Rendezvous:
    KIND: ClassVar[str] = "rendezvous"
    backend: str
    store_host: str
    store_port: int
    key: str
    timeout_ms: int


@dataclass(frozen=True)
class KVHeader:
    KIND: ClassVar[str] = "kv"
    request_id: str
    layer: int
    block_ids: list[int]
    dtype: str
    shape: list[int]
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class BulkKVHeader:
    KIND: ClassVar[str] = "kv_bulk"
    request_id: str
    layer: int
    block_ids: list[int]
    dtype: str
    shape: list[int]
    bulk_nbytes: int


@dataclass(frozen=True)
class StoredKV:
    KIND: ClassVar[str] = "kv_stored"
    request_id: str
    layer: int
    block_ids: list[int]
    dtype: str
    shape: list[int]
    stored_nbytes: int
    checksum: int
    part: int


@dataclass(frozen=True)
class Lost:
    KIND: ClassVar[str] = "lost"
    request_id: str
    reason: str


@dataclass(frozen=True)
class Done:
    KIND: ClassVar[str] = "done"
    request_id: str
    first_token_id: int
    first_logprob: float | None
    num_tokens: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Error:
    KIND: ClassVar[str] = "error"
    request_id: str
    reason: str


Header = Hello | Auth | Ready | Pools | Rendezvous | KVHeader | BulkKVHeader | StoredKV | Lost | Done | Error
_HEADER_TYPES: dict[str, type[Header]] = {
    cls.KIND: cls for cls in (Hello, Auth, Ready, Pools, Rendezvous, KVHeader, BulkKVHeader, StoredKV, Lost, Done,
                              Error)
}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "bytes": (bytes,), "bytes | None": (bytes, NoneType), "str": (str,), "int": (int,),
    "list[int]": (list,), "float | None": (float, NoneType), "list[float]": (list,),
}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} cannot be sent; supported: {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def auth_mac(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), _AUTH_CONTEXT + nonce, hashlib.sha256).digest()


def check_auth(secret: str | None, nonce: bytes, auth: Auth) -> None:
    if secret is None:
        return
    if auth.mac is None or not hmac.compare_digest(auth.mac, auth_mac(secret, nonce)):
        raise ProtocolError("authentication failed: the sender's secret does not match")


# ---- encoding -----------------------------------------------------------------------------------


def encode_frame(header: Header, payload: memoryview | bytes = b"") -> list[bytes | memoryview]:
    """Buffers to write in order (the payload is not copied)."""
    packed = pack_header(header)
    return [_LENGTH.pack(len(packed)) + packed, payload]


def pack_header(header: Header) -> bytes:
    """A header's msgpack map, which `decode_header` reads back (a frame prefixes its length)."""
    fields_map = {f.name: getattr(header, f.name) for f in fields(header)}
    fields_map.setdefault("nbytes", 0)
    packed: bytes = msgpack.packb({"version": WIRE_VERSION, "kind": header.KIND, **fields_map}, use_bin_type=True)
    return packed


def done_frame(request_id: str, first_token_id: int, first_logprob: float | None, num_tokens: int,
               first_top: Sequence[tuple[int, float]] = ()) -> Done:
    """The "done" header: the first token with its logprob and top-k alternatives (floats on the wire)."""
    return Done(request_id, first_token_id, first_logprob, num_tokens, [int(t) for t, _ in first_top],
                [float(lp) for _, lp in first_top])


def kv_frame(request_id: str, layer: int, block_ids: list[int], blocks: torch.Tensor,
             checksum: int | None = None) -> list[bytes | memoryview]:
    """A "kv" frame for host blocks [2, len(block_ids), block_size, Hkv, D]; `checksum`: their bytes' CRC-32,
    when the caller has it already."""
    payload = tensor_bytes(blocks)
    header = KVHeader(
        request_id, layer, list(block_ids), dtype_name(blocks.dtype), list(blocks.shape),
        payload.nbytes, zlib.crc32(payload) if checksum is None else checksum,
    )
    return encode_frame(header, payload)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor without a copy when it is contiguous (works for bfloat16 too)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor must be on the host to be sent, got {tensor.device}")
    return memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy())


def tensor_from_payload(payload: torch.Tensor, header: KVHeader) -> torch.Tensor:
    """The blocks a kv frame's payload holds: its bytes (a uint8 tensor, e.g. the pinned buffer it was read
    into) as the header's dtype and shape, without a copy."""
    return payload.view(DTYPES[header.dtype]).view(header.shape)


# ---- decoding -----------------------------------------------------------------------------------


def decode_header(raw: bytes) -> Header:
    """Parse and type-check a header; any deviation is a ProtocolError."""
    try:
        # unpackb bounds every length by len(raw) (<= max_header_bytes): no huge allocations here.
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError) as exc:  # msgpack.*Error derive from ValueError
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"header must be a map, got {type(obj).__name__}")
    if obj.get("version") != WIRE_VERSION:
        raise ProtocolError(f"wire version {obj.get('version')!r} is not {WIRE_VERSION}")
    cls = _HEADER_TYPES.get(obj.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown frame kind {obj.get('kind')!r}")
    nbytes = obj.get("nbytes")
    if type(nbytes) is not int or nbytes < 0 or (cls is not KVHeader and nbytes != 0):
        raise ProtocolError(f"{cls.KIND} frame has bad nbytes {nbytes!r}")
    return cls(**{f.name: _field(obj, cls.KIND, f.name, str(f.type), f.default_factory) for f in fields(cls)})


def _field(obj: dict[str, Any], kind: str, name: str, type_name: str, default: object = MISSING) -> Any:
    """The field's value, checked here against the type its dataclass declares (`type_name`)."""
    if name not in obj:
        if default is not MISSING:  # a field added later, with a default: a frame may lack it
            return default()  # type: ignore[operator]
        raise ProtocolError(f"{kind} frame lacks {name!r}")
    value = obj[name]
    if type(value) not in _FIELD_TYPES[type_name]:  # exact: True is not an int here
        raise ProtocolError(f"{kind} frame field {name!r} must be {type_name}, got {type(value).__name__}")
    if type_name == "list[int]" and not all(type(v) is int for v in value):
        raise ProtocolError(f"{kind} frame field {name!r} must hold only ints")
    if type_name == "list[float]" and not all(type(v) is float for v in value):
        raise ProtocolError(f"{kind} frame field {name!r} must hold only floats")
    return value


# ---- async reading ------------------------------------------------------------------------------


async def read_header(reader: asyncio.StreamReader, limits: FrameLimits) -> Header | None:
    """Next frame's header, or None when the peer closed cleanly between frames."""
    try:
        async with asyncio.timeout(limits.idle_timeout_s):
            prefix = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("connection closed inside a frame's length prefix") from None
    except TimeoutError:
        raise ProtocolError(f"no frame for {limits.idle_timeout_s} s") from None
    (length,) = _LENGTH.unpack(prefix)
    if not 0 < length <= limits.max_header_bytes:
        raise ProtocolError(f"header length {length} outside 1..{limits.max_header_bytes} bytes")
    raw = await _read_exactly(reader, length, limits.read_timeout_s, "header")
    return decode_header(raw)


async def read_payload(reader: PayloadReader, header: KVHeader, limits: FrameLimits,
                       into: memoryview | None = None) -> memoryview:
    """The payload announced by an already-validated header, checksum verified: in `into` (header.nbytes
    writable bytes, e.g. pinned host memory) or a new bytearray. The socket receives straight into it
    (kv_transfer/payload_reader.py), and each 1 MiB piece is summed on the sums' threads as soon as it has
    arrived, in parallel, the CRC-32s combined at the end (kv_transfer/checksum.py): the loop only receives,
    and after the last byte only the last piece is left to sum."""
    view = memoryview(bytearray(header.nbytes)) if into is None else into
    if view.nbytes != header.nbytes:
        raise ValueError(f"payload buffer of {view.nbytes} bytes for a payload of {header.nbytes}")
    sums = PieceSums(view)
    filled = 0
    try:
        while filled < header.nbytes:
            try:
                async with asyncio.timeout(limits.read_timeout_s):
                    n = await reader.read_into(view[filled:])
            except TimeoutError:
                raise ProtocolError(f"payload read stalled at {filled} of {header.nbytes} bytes") from None
            if not n:
                raise ProtocolError(f"connection closed after {filled} of {header.nbytes} payload bytes")
            filled += n
            sums.filled(filled)
        checksum = await sums.result()
    finally:
        sums.cancel()
    if checksum != header.checksum:
        raise ProtocolError(f"payload checksum {checksum:#010x} != header's {header.checksum:#010x}")
    return view


async def _read_exactly(reader: asyncio.StreamReader, n: int, timeout_s: float, what: str) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(f"connection closed after {len(exc.partial)} of {n} {what} bytes") from None
    except TimeoutError:
        raise ProtocolError(f"{what} read of {n} bytes timed out after {timeout_s} s") from None


async def write_frame(writer: asyncio.StreamWriter, buffers: list[bytes | memoryview]) -> None:
    # write() per buffer, not writelines(): that joins header and payload into one new bytes object
    # (a full copy of the payload: 1.1 s of a 2.9 s, 768 MiB loopback run on the 2-core dev box).
    for buffer in buffers:
        if len(buffer):
            writer.write(buffer)
    await writer.drain()
