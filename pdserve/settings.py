"""Typed settings, one frozen dataclass per concern, validated on construction.

A worker process receives a `WorkerSettings` composed of `ModelSettings` (what to load and where),
`KVCacheSettings` (how big the paged pool is), `SchedulerSettings` (batching limits), `TransferSettings`
(how KV moves between P and D), `ServerSettings` (HTTP address, router, secret) and the KV cache tiers'
`TierConfig` + `CachePolicy` (cache_store/policy.py: host RAM, Redis; eviction, write and admission policies).
Each component is handed only its own part. `LaunchSettings` describes what `pdserve serve` starts. Nothing here reads the environment:
the command modules do that and pass values in.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from pdserve.cache_store.policy import CachePolicy, TierConfig, add_cache_arguments, cache_settings_from_args

ROLES = ("prefill", "decode")
DEFAULT_MODEL = "smollm2-135m-instruct"
LOAD_FORMATS = ("auto", "gguf", "hf", "dummy")  # hf: a Hugging Face directory of safetensors
DTYPES = ("auto", "float32", "float16", "bfloat16")
TRANSFER_BACKENDS = ("auto", "local", "tcp", "cuda_ipc", "nccl")  # cuda_ipc: one host's GPUs; nccl: torch.distributed
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # decode_node/scheduler.py
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
    """What the engine loads: a model name, a .gguf file or a HF directory; or (dummy) random weights of
    `model_preset` (or of the preset matching `model`)."""

    model: str = DEFAULT_MODEL
    load_format: str = "auto"
    model_preset: str | None = None
    tokenizer: str | None = None  # a directory with tokenizer.json, overriding the model's
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    cache_dir: str | None = None
    max_model_len: int | None = None
    seed: int = 0  # dummy weights
    torch_threads: int | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode steps (CPU is always eager)

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load format {self.load_format!r}; choose one of {LOAD_FORMATS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


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


@dataclass(frozen=True)
class SchedulerSettings:
    """Batching limits of both roles, their queue bounds, and the decode-side reservation lease."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # longest silence of a transfer (every KV frame renews it; before the first, P's queueing counts too)
    kv_lease_timeout_s: float = 120.0
    kv_load_failure_policy: str = "recompute"  # the KV did not arrive: "fail" the request, or "recompute" it on D
    watermark_blocks: int = 1  # D keeps this many blocks free at reserve time, for running sequences to grow
    # requests held waiting beyond the running batch (P: queued for prefill; D: reserved, not yet running);
    # past it new work gets 503 + Retry-After, and the router tries another worker
    max_queued_requests: int = 1024

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
    """HTTP address of the worker, and the routers it registers with (None: static, no registration).

    `router_url` is one URL or several, comma-separated; a URL whose host is a name (a Kubernetes headless
    Service, a Compose service) stands for every address the name resolves to, looked up again every
    `router_resolve_interval_s` (pdserve/router_links.py)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    router_url: str | None = None
    router_resolve_interval_s: float = 5.0
    secret: str | None = None
    worker_id: str | None = None
    heartbeat_interval_s: float = 1.0  # until the router answers with its own
    advertise_host: str | None = None  # the host others reach this worker at (None: the bind address's IP)
    drain_on_sigterm: bool = False  # SIGTERM finishes the requests held first (containers), else stops in 3 s

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
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
    num_colocated: int = 1  # with colocated: that many replicas, each over its own pool (one per GPU)
    num_routers: int = 1  # every worker registers with each (pdserve/router_links.py)
    worker_args: tuple[str, ...] = ()  # passed through to every worker command line
    router_args: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0
    # P -> D: auto is cuda_ipc when the workers run on this host's GPUs, else tcp; --colocated uses local
    transfer_backend: str = "auto"

    def __post_init__(self) -> None:
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


# ---- command-line flags (shared by `pdserve prefill`, `pdserve decode` and `pdserve serve`) ----------------


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"model name, .gguf file or Hugging Face directory (default {DEFAULT_MODEL})")
    group.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    group.add_argument("--model-preset", default=None, help="shapes for --load-format dummy, e.g. llama3-8b")
    group.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (dummy weights have none)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    group.add_argument("--dtype", default="auto", choices=DTYPES)
    group.add_argument("--torch-threads", type=int, default=None,
                       help="CPU threads per worker (default: torch's, one per core; use 1 when several "
                            "workers share few cores)")
    group.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run decode steps eagerly instead of replaying one CUDA graph per batch bucket "
                            "(CUDA only; CPU always runs eagerly)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache and batching")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    size.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV pool size, e.g. 2GiB")
    group.add_argument("--gpu-memory-utilization", type=float, default=KVCacheSettings.gpu_memory_utilization,
                       help="without --num-blocks/--kv-cache-memory on CUDA: the share of the GPU's memory this "
                            "worker may fill, weights included (workers sharing a GPU take a share each)")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-seqs", type=int, default=SchedulerSettings.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=SchedulerSettings.max_num_batched_tokens)
    group.add_argument("--kv-lease-timeout", type=float, default=SchedulerSettings.kv_lease_timeout_s,
                       help="seconds a decode reservation waits without receiving KV (each KV frame renews it)")
    group.add_argument("--kv-load-failure-policy", default=SchedulerSettings.kv_load_failure_policy,
                       choices=KV_LOAD_FAILURE_POLICIES,
                       help="a decode reservation whose KV did not arrive (lease ran out, prefill worker gone): "
                            "fail the request, or recompute its prompt on the decode worker")
    group.add_argument("--max-queued-requests", type=int, default=SchedulerSettings.max_queued_requests,
                       help="requests a worker holds waiting beyond its running batch; more get 503 + Retry-After")


def add_worker_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--role", default=role, choices=("prefill", "decode", "both"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    parser.add_argument("--router", default=None,
                        help="router URL(s) to register with, comma-separated, e.g. http://127.0.0.1:8000; a host "
                             "name stands for every address it resolves to (a headless Service: every router)")
    parser.add_argument("--router-resolve-interval", type=float, default=ServerSettings.router_resolve_interval_s,
                        help="seconds between DNS lookups of --router's host names (routers added or gone)")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--advertise-host", default=None,
                        help="host name or IP the router and other workers reach this worker at (default: the IP "
                             "of --host; in a container, its own address)")
    parser.add_argument("--drain-on-sigterm", action="store_true",
                        help="on SIGTERM, take no new work, finish the requests held, deregister, then exit "
                             "(a second SIGTERM stops at once)")
    parser.add_argument("--transfer-backend", default="auto", choices=TRANSFER_BACKENDS)
    parser.add_argument("--transfer-host", default=None, help="address of the KV receiver (default: --host)")
    parser.add_argument("--transfer-port", type=int, default=0, help="KV receiver port (0: any free port)")
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_cache_arguments(parser)


def model_settings_from_args(args: argparse.Namespace, cache_dir: str | None) -> ModelSettings:
    return ModelSettings(model=args.model, load_format=args.load_format, model_preset=args.model_preset,
                         tokenizer=args.tokenizer, device=args.device, dtype=args.dtype, cache_dir=cache_dir,
                         max_model_len=args.max_model_len, torch_threads=args.torch_threads,
                         enforce_eager=args.enforce_eager)


def worker_settings_from_args(args: argparse.Namespace, cache_dir: str | None,
                              secret: str | None) -> WorkerSettings:
    """`cache_dir` and `secret` come from the environment, which only the command module reads."""
    tiers, cache_policy = cache_settings_from_args(args, pin_host_memory=_uses_cuda(args.device))
    return WorkerSettings(
        roles=parse_roles(args.role),
        model=model_settings_from_args(args, cache_dir),
        cache=KVCacheSettings(num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
                              block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerSettings(max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_lease_timeout_s=args.kv_lease_timeout,
                                    kv_load_failure_policy=args.kv_load_failure_policy,
                                    max_queued_requests=args.max_queued_requests),
        transfer=TransferSettings(backend=args.transfer_backend, host=args.transfer_host or args.host,
                                  port=args.transfer_port),
        server=ServerSettings(host=args.host, port=args.port, router_url=args.router,
                              router_resolve_interval_s=args.router_resolve_interval, secret=secret,
                              worker_id=args.worker_id, advertise_host=args.advertise_host,
                              drain_on_sigterm=args.drain_on_sigterm),
        tiers=tiers, cache_policy=cache_policy,
    )


def _uses_cuda(device: str) -> bool:
    """Whether the KV pool will live on a GPU (then the host tier is pinned: DMA straight to the device)."""
    if device == "auto":
        import torch  # only here: settings stay light for the router

        return torch.cuda.is_available()
    return device.startswith("cuda")
