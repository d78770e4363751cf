"""Typed settings, one frozen dataclass per concern, validated on construction.

A worker process receives a `WorkerSettings` composed of `ModelSettings` (what to load and where),
`KVCacheSettings` (how big the paged pool is), `SchedulerSettings` (batching limits), `TransferSettings`
(how KV moves between P and D), `ServerSettings` (HTTP address, router, secret) and the KV cache tiers'
`TierConfig` + `CachePolicy` (cache_store/policy.py: host RAM, Redis; eviction, write and admission policies).
Each component is handed only its own part. `LaunchSettings` describes what `pdserve serve` starts. The
command-line flags that build them are in worker/flags.py. Nothing here reads the environment: the
command modules do that and pass values in.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.supervision import RestartPolicy

if TYPE_CHECKING:
    from pdserve.engine.weights.hub import HubOptions

ROLES = ("prefill", "decode")
DEFAULT_MODEL = "smollm2-135m-instruct"
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")  # hf: a Hugging Face directory of safetensors
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: --dtype; fp8: float8_e4m3fn (engine/kv_cache_spec.py, which checks it too)
# what --kv-cache-dtype accepts: fp8_e4m3 is vLLM's other name for fp8 and SGLang's only one (an e4m3 cache is
# what both store on Hopper); fp8_e5m2 is not built, and argparse names what is
KV_CACHE_DTYPE_FLAGS = (*KV_CACHE_DTYPES, "fp8_e4m3")
QUANTIZATIONS = ("none", "fp8")  # of the layers' linears (engine/model.py fuse_weights)
QUANTIZATION_HELP = ("fp8: the layers' linears in float8 e4m3, weights per output channel, activations per token "
                     "(embeddings, norms and lm_head stay in --dtype); none: every weight in --dtype (default: as "
                     "the checkpoint is, fp8 for an FP8 checkpoint)")
# cuda_ipc: one host's GPUs; nccl: torch.distributed; store: through a store both pools reach (kv_transfer/store/)
TRANSFER_BACKENDS = ("auto", "local", "tcp", "cuda_ipc", "nccl", "store")
TRANSFER_STORES = ("auto", "shm", "redis")  # auto: redis when --redis-url is given, else shm (one host)
DEFAULT_STORE_DIR = "/dev/shm/pdserve" if os.path.isdir("/dev/shm") else os.path.join(tempfile.gettempdir(), "pdserve")
# one value of the store transfer holds at most this much of a layer's send. 4 MiB: the only size within 16% of
# the fastest for shm and Redis in two CPU runs of a 512 MiB llama3-8b KV (0.25 MiB: 1.7-2.2x the time; 8-16 MiB:
# Redis 1.1-1.6x); benchmarks/results/transfer_backends_cpu*.json, docs/architecture.md (the store's costs)
DEFAULT_CHUNK_BYTES = 4 << 20
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # decode_node/scheduler.py
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def canonical_kv_cache_dtype(flag: str) -> str:
    """--kv-cache-dtype as given (any of KV_CACHE_DTYPE_FLAGS) -> one of KV_CACHE_DTYPES."""
    return "fp8" if flag == "fp8_e4m3" else flag


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
    """What the engine loads: a model name, a .gguf file, a HF directory or repo id (found in the hub cache
    `download_dir`, at `revision`); or (dummy) random weights of `model_preset` (or of the preset matching
    `model`). `served_model_names`: what clients call it (empty: the model's own name)."""

    model: str = DEFAULT_MODEL
    load_format: str = "auto"
    model_preset: str | None = None
    tokenizer: str | None = None  # a directory with tokenizer.json, overriding the model's
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: str = "auto"  # auto: `dtype`; fp8: float8_e4m3fn with per-layer scales
    calculate_kv_scales: bool = False  # fp8 cache: scales from a built-in text at start (engine/kv_scale_calibration.py)
    quantization: str | None = None  # "fp8" | "none"; None: as the checkpoint is (engine/weights/loader.py)
    cache_dir: str | None = None
    max_model_len: int | None = None
    seed: int = 0  # dummy weights, and the worker's torch RNG
    torch_threads: int | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode steps (CPU is always eager)
    revision: str | None = None  # of a repo id; None: main
    download_dir: str | None = None  # hub cache of repo ids; None: huggingface_hub's (HF_HUB_CACHE, HF_HOME/hub)
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {self.torch_threads}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load format {self.load_format!r}; choose one of {LOAD_FORMATS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError(f"--calculate-kv-scales needs --kv-cache-dtype fp8, not {self.kv_cache_dtype!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {QUANTIZATIONS}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError(f"served model names must not be empty, got {list(self.served_model_names)}")

    @property
    def hub(self) -> HubOptions:
        from pdserve.engine.weights.hub import HubOptions  # here only: pdserve.engine.weights imports torch

        return HubOptions(revision=self.revision, cache_dir=self.download_dir)


@dataclass(frozen=True)
class KVCacheSettings:
    """Size of the paged KV pool: either a block count or a memory budget (bytes), not both."""

    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    block_size: int = 16
    # when neither is given: this much host memory on CPU; on CUDA, up to this fraction of the device's memory
    # for this process (weights included), so that workers sharing a GPU can be given a share each
    default_cpu_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.8
    enable_prefix_caching: bool = True  # off: no block is named, every prompt computed in full
    # a decode worker's reservations take the prompt's prefix cached on it (finished sequences' prompt + output)
    # and P sends only the rest; off: every reservation takes new blocks and P sends the whole prompt
    decode_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                f"give --num-blocks ({self.num_blocks}) or --kv-cache-memory ({self.kv_cache_memory} bytes), not both"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu memory utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")

    @property
    def sized_explicitly(self) -> bool:
        return self.num_blocks is not None or self.kv_cache_memory is not None

    def resolve_num_blocks(self, bytes_per_block: int, device_budget: int | None = None) -> int:
        """Blocks that fit: num_blocks as given, or a memory budget // bytes_per_block. The budget is
        kv_cache_memory; else on CUDA `device_budget` (engine/kv_cache.gpu_kv_budget, from
        `gpu_memory_utilization`); else `default_cpu_memory`."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_cache_memory
        if budget is None:
            budget = device_budget if device_budget is not None else self.default_cpu_memory
        count = budget // bytes_per_block
        if count < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block ({bytes_per_block} bytes each)")
        return count


GPU_MAX_NUM_SEQS = 256  # vLLM's default; decode is memory-bound, so a GPU step barely grows with the batch


@dataclass(frozen=True)
class SchedulerSettings:
    """Batching limits of both roles, their queue bounds, and the decode-side reservation lease."""

    max_num_seqs: int = 64  # on CPU; a worker on a GPU takes GPU_MAX_NUM_SEQS unless told
    max_num_batched_tokens: int = 2048
    # longest silence of a transfer (every KV frame renews it; before the first, P's queueing counts too)
    kv_lease_timeout_s: float = 120.0
    kv_load_failure_policy: str = "recompute"  # the KV did not arrive: "fail" the request, or "recompute" it on D
    watermark_blocks: int = 1  # D keeps this many blocks free at reserve time, for running sequences to grow
    # requests held waiting beyond the running batch (P: queued for prefill; D: reserved, not yet running);
    # past it new work gets 503 + Retry-After, and the router tries another worker
    max_queued_requests: int = 1024
    # decode: schedule and launch step N+1 while step N runs on the device (same outputs; False: one at a time)
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.kv_lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s must be positive, got {self.kv_lease_timeout_s}")
        if self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if self.max_queued_requests <= 0:
            raise ValueError(f"max_queued_requests must be positive, got {self.max_queued_requests}")


@dataclass(frozen=True)
class FaultSettings:
    """Test-only fault injection, off in service: `hang_step_after` N makes the step threads' forward after
    the N-th block until the worker stops while its event loop runs on (engine/step_liveness.py): the hung
    forward that tests/e2e/test_stalled_steps.py makes the router detect."""

    hang_step_after: int | None = None

    def __post_init__(self) -> None:
        if self.hang_step_after is not None and self.hang_step_after < 0:
            raise ValueError(f"fault_hang_step_after must be >= 0, got {self.hang_step_after}")


@dataclass(frozen=True)
class TransferSettings:
    """KV transfer backend; host/port are where this worker's receiver listens (decode role, tcp).

    `auto` is `local` for a `--role both` worker (no copy, one pool) and `tcp` otherwise. The `store` backend
    goes through `store` (shm: `store_dir` on this host; redis: the tiers' --redis-url) in values of at most
    `chunk_bytes`; WorkerSettings resolves its `auto`."""

    backend: str = "auto"
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    store: str = "auto"
    store_dir: str = DEFAULT_STORE_DIR
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_BACKENDS:
            raise ValueError(f"unknown transfer backend {self.backend!r}; choose one of {TRANSFER_BACKENDS}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"transfer port must be in [0, 65535], got {self.port}")
        if self.store not in TRANSFER_STORES:
            raise ValueError(f"unknown transfer store {self.store!r}; choose one of {TRANSFER_STORES}")
        if self.chunk_bytes <= 0:
            raise ValueError(f"--transfer-chunk-size must be positive, got {self.chunk_bytes} bytes")


@dataclass(frozen=True)
class ServerSettings:
    """HTTP address of the worker, its data-plane port, and the routers it registers with (None: static, no
    registration).

    `router_url` is one URL or several, comma-separated; a URL whose host is a name (a Kubernetes headless
    Service, a Compose service) stands for every address the name resolves to, looked up again every
    `router_resolve_interval_s` (worker/router_links.py)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    data_port: int = 0  # the routers' multiplexed connection (protocol/); 0: any free port
    router_url: str | None = None
    router_resolve_interval_s: float = 5.0
    secret: str | None = None
    worker_id: str | None = None
    heartbeat_interval_s: float = 1.0  # until the router answers with its own
    advertise_host: str | None = None  # the host others reach this worker at (None: the bind address's IP)
    drain_on_sigterm: bool = False  # SIGTERM finishes the requests held first (containers), else stops in 3 s
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("port", "data_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for url in self.router_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--router takes http(s) URLs (comma-separated), got {url!r} in {self.router_url!r}")
        if self.router_url is not None and not self.router_urls:
            raise ValueError(f"--router names no URL: {self.router_url!r}")
        if self.router_resolve_interval_s <= 0:
            raise ValueError(f"router_resolve_interval_s must be positive, got {self.router_resolve_interval_s}")

    @property
    def router_urls(self) -> tuple[str, ...]:
        if self.router_url is None:
            return ()
        return tuple(url.strip().rstrip("/") for url in self.router_url.split(",") if url.strip())


@dataclass(frozen=True)
class WorkerSettings:
    roles: tuple[str, ...]
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    tiers: TierConfig = field(default_factory=TierConfig)
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    faults: FaultSettings = field(default_factory=FaultSettings)

    def __post_init__(self) -> None:
        if not self.roles or any(role not in ROLES for role in self.roles):
            raise ValueError(f"roles must be a non-empty subset of {ROLES}, got {self.roles}")
        if not self.cache.enable_prefix_caching and (self.tiers.host_capacity_gb or self.tiers.redis_url):
            raise ValueError(f"--no-enable-prefix-caching keeps no prefix, so the host ({self.tiers.host_capacity_gb} "
                             f"GiB) and Redis ({self.tiers.redis_url}) tiers would hold nothing: drop one or the other")
        if self.transfer.backend == "auto":
            backend = "local" if self.colocated else "tcp"
            object.__setattr__(self, "transfer", dataclasses.replace(self.transfer, backend=backend))
        if not self.colocated and self.transfer.backend == "local":
            raise ValueError(f"the local transfer backend needs --role both, this worker is {self.roles}")
        if self.transfer.backend == "store":
            object.__setattr__(self, "transfer", dataclasses.replace(self.transfer, store=self._transfer_store()))

    def _transfer_store(self) -> str:
        """`--transfer-store auto`: redis with --redis-url, else shm, which only one host's workers share."""
        store, redis_url = self.transfer.store, self.tiers.redis_url
        if store == "redis" and not redis_url:
            raise ValueError("--transfer-store redis needs --redis-url: the store every worker writes and reads")
        if store != "auto":
            return store
        if redis_url:
            return "redis"
        if self.server.host not in _LOOPBACK and not self.server.host.startswith("127."):
            raise ValueError(f"--transfer-backend store on a worker reachable from other hosts (--host "
                             f"{self.server.host}) needs a store that every host reaches: give --redis-url, or "
                             f"--transfer-store shm if every worker runs on this host ({self.transfer.store_dir})")
        return "shm"

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
    num_colocated: int = 1  # with colocated: that many replicas, each over its own pool (one per GPU)
    num_routers: int = 1  # every worker registers with each (worker/router_links.py)
    worker_args: tuple[str, ...] = ()  # passed through to every worker command line
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0
    # P -> D: auto is cuda_ipc when the workers run on this host's GPUs, else tcp; --colocated uses local
    transfer_backend: str = "auto"
    # the router answers https (router_args carry --ssl-*); the workers reach it on a plain loopback listener
    router_tls: bool = False
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # children that exit (pdserve/supervision.py)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.ready_timeout_s > 0:
            raise ValueError(f"--ready-timeout must be positive, got {self.ready_timeout_s}")
        if self.transfer_backend not in TRANSFER_BACKENDS or self.transfer_backend == "local":
            choices = [b for b in TRANSFER_BACKENDS if b != "local"]
            raise ValueError(f"unknown transfer backend {self.transfer_backend!r} for serve; choose one of {choices}")
        if self.colocated and self.transfer_backend != "auto":
            raise ValueError(f"--transfer-backend {self.transfer_backend} moves KV between a prefill and a decode "
                             f"worker; --colocated runs one worker over one pool (no transfer)")
        if self.num_colocated < 1 or (self.num_colocated > 1 and not self.colocated):
            raise ValueError(f"--num-colocated {self.num_colocated}: give a positive count, together with --colocated")
        if self.num_routers < 1:
            raise ValueError(f"--num-routers {self.num_routers}: a deployment needs at least one router")
        if not self.colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(
                f"a disaggregated launch needs >= 1 prefill and >= 1 decode worker, "
                f"got {self.num_prefill} and {self.num_decode}"
            )
