"""Where P must push a request's KV: the descriptor D returns from its reserve endpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TransferTarget:
    """A reservation on a decode worker.

    `block_ids` are D's blocks for the prompt's blocks `first_block` on, in token order (block i of the list holds
    tokens (first_block + i) * block_size ..); the leading `first_block` blocks are D's own cached prefix, never
    sent (a delta transfer), so a target fits a prompt exactly when first_block + len(block_ids) blocks hold
    it. `host`/`port` are
    unset for the in-process `local` backend and for `store`, which names instead the shared store D reads
    (`store`: its store_id), D's inbox there and the reservation's random `token` (kv_transfer/store/). The
    shape fields let P refuse a mismatched D before it computes anything, and so does `kv_fingerprint`: D's KV
    compatibility key (engine/kv_cache_spec.py: the model fingerprint, or for an fp8 cache a digest of it, the
    KV dtype and the per-layer scales), which P's must equal.
    """

    backend: str
    request_id: str
    block_ids: tuple[int, ...]
    num_layers: int
    block_size: int
    dtype: str
    host: str | None = None
    port: int | None = None
    store: str | None = None
    inbox: str | None = None
    token: str | None = None
    first_block: int = 0
    kv_fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.block_ids:
            raise ValueError(f"transfer target for {self.request_id!r} has no blocks")
        if self.first_block < 0:
            raise ValueError(f"transfer target for {self.request_id!r}: first_block {self.first_block} < 0")
        if self.num_layers <= 0 or self.block_size <= 0:
            raise ValueError(f"bad target shape: {self.num_layers} layers, block_size {self.block_size}")
        if (self.host is None) != (self.port is None):
            raise ValueError(f"host and port go together, got host={self.host!r} port={self.port!r}")
        if self.backend == "store" and None in (self.store, self.inbox, self.token):
            raise ValueError(f"a store target names its store, inbox and token, got {self.store!r}, {self.inbox!r}, "
                             f"{self.token!r}")

    @property
    def address(self) -> tuple[str, int]:
        if self.host is None or self.port is None:
            raise ValueError(f"{self.backend} target for {self.request_id!r} has no network address")
        return self.host, self.port

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "block_ids": list(self.block_ids)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferTarget:
        """Build from JSON; wrong or missing fields raise ValueError naming them."""
        expected = {"backend": str, "request_id": str, "block_ids": list, "num_layers": int,
                    "block_size": int, "dtype": str}
        for name, kind in expected.items():
            if type(data.get(name)) is not kind:
                raise ValueError(f"transfer target field {name!r} must be {kind.__name__}, got {data.get(name)!r}")
        if not all(type(b) is int and b >= 0 for b in data["block_ids"]):
            raise ValueError("transfer target block_ids must be non-negative ints")
        host, port = data.get("host"), data.get("port")
        if not (host is None or type(host) is str) or not (port is None or type(port) is int):
            raise ValueError(f"transfer target address must be str/int, got {host!r}:{port!r}")
        store = {name: data.get(name) for name in ("store", "inbox", "token")}
        for name, value in store.items():
            if not (value is None or type(value) is str):
                raise ValueError(f"transfer target field {name!r} must be str or null, got {value!r}")
        first_block = data.get("first_block", 0)
        if type(first_block) is not int:
            raise ValueError(f"transfer target field 'first_block' must be int, got {first_block!r}")
        kv_fingerprint = data.get("kv_fingerprint", "")
        if type(kv_fingerprint) is not str:
            raise ValueError(f"transfer target field 'kv_fingerprint' must be str, got {kv_fingerprint!r}")
        return cls(
            backend=data["backend"], request_id=data["request_id"], block_ids=tuple(data["block_ids"]),
            num_layers=data["num_layers"], block_size=data["block_size"], dtype=data["dtype"],
            host=host, port=port, **store, first_block=first_block, kv_fingerprint=kv_fingerprint,
        )
