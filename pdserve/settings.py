"""Typed settings, one frozen dataclass per concern, validated on construction.

A worker process receives a `WorkerSettings` composed of `ModelSettings` (what to load and where),
`KVCacheSettings` (how big the paged pool is), `SchedulerSettings` (batching limits), `TransferSettings`
(how KV moves between P and D) and `ServerSettings` (HTTP address, router, secret). Each component is handed
only its own part. `LaunchSettings` describes what `pdserve serve` starts. Nothing here reads the environment:
the command modules do that and pass values in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")
DEFAULT_MODEL = "smollm2-135m-instruct"
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
TRANSFER_BACKENDS = ("auto", "local", "tcp")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'512MiB' / '2G' / '1048576' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 512MiB or 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_roles(text: str) -> tuple[str, ...]:
    """'prefill' | 'decode' | 'both' -> the roles a worker serves."""
    if text == "both":
        return ROLES
    if text not in ROLES:
        raise ValueError(f"unknown role {text!r}; choose prefill, decode or both")
    return (text,)


@dataclass(frozen=True)
class ModelSettings:
    """What the engine loads: a model name, a .gguf file or a HF directory; or random weights of a preset."""

    model: str = DEFAULT_MODEL
    load_format: str = "auto"
    model_preset: str | None = None
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    cache_dir: str | None = None
    max_model_len: int | None = None
    seed: int = 0  # dummy weights

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load format {self.load_format!r}; choose one of {LOAD_FORMATS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.load_format == "dummy" and not self.model_preset:
            raise ValueError("--load-format dummy needs --model-preset (random weights of which shapes?)")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class KVCacheSettings:
    """Size of the paged KV pool: either a block count or a memory budget (bytes), not both."""

    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    block_size: int = 16
    default_num_blocks: int = 2048  # when neither is given: 32k tokens of KV

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                f"give --num-blocks ({self.num_blocks}) or --kv-cache-memory ({self.kv_cache_memory} bytes), not both"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Blocks that fit: num_blocks as given, or kv_cache_memory // bytes_per_block."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory is None:
            return self.default_num_blocks
        count = self.kv_cache_memory // bytes_per_block
        if count < 1:
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_memory} bytes holds no block ({bytes_per_block} bytes each)"
            )
        return count


@dataclass(frozen=True)
class SchedulerSettings:
    """Batching limits of both roles and the decode-side reservation lease."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_lease_timeout_s: float = 30.0
    watermark_blocks: int = 1  # D keeps this many blocks free at reserve time, for running sequences to grow

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.kv_lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s must be positive, got {self.kv_lease_timeout_s}")
        if self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")


@dataclass(frozen=True)
class TransferSettings:
    """KV transfer backend; host/port are where this worker's receiver listens (decode role, tcp).

    `auto` is `local` for a `--role both` worker (no copy, one pool) and `tcp` otherwise."""

    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_BACKENDS:
            raise ValueError(f"unknown transfer backend {self.backend!r}; choose one of {TRANSFER_BACKENDS}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"transfer port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class ServerSettings:
    """HTTP address of the worker, and the router it registers with (None: static, no registration)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    router_url: str | None = None
    secret: str | None = None
    worker_id: str | None = None
    heartbeat_interval_s: float = 1.0  # until the router answers with its own

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"--router must be an http(s) URL, got {self.router_url!r}")


@dataclass(frozen=True)
class WorkerSettings:
    roles: tuple[str, ...]
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    server: ServerSettings = field(default_factory=ServerSettings)

    def __post_init__(self) -> None:
        if not self.roles or any(role not in ROLES for role in self.roles):
            raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {self.roles}")
        if self.transfer.backend == "auto":
            backend = "local" if self.colocated else "tcp"
            object.__setattr__(self, "transfer", TransferSettings(backend, self.transfer.host, self.transfer.port))
        if not self.colocated and self.transfer.backend == "local":
            raise ValueError(f"the local transfer backend needs --role both, this worker is {self.roles}")

    @property
    def colocated(self) -> bool:
        return set(self.roles) == set(ROLES)

    @property
    def role_name(self) -> str:
        return "both" if len(self.roles) == 2 else self.roles[0]


@dataclass(frozen=True)
class LaunchSettings:
    """`pdserve serve`: a router plus workers on this machine, as separate processes."""

    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    worker_args: tuple[str, ...] = ()  # passed through to every worker command line
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(
                f"a disaggregated launch needs >= 1 prefill and >= 1 decode worker, "
                f"got {self.num_prefill} and {self.num_decode}"
            )
