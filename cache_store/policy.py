"""How the KV cache tiers behave: a deployment's fixed `TierConfig` and its run-time `CachePolicy`.

    TierConfig   sizes and endpoints, fixed for the worker's life: host capacity, Redis URL, I/O limits
    CachePolicy  behaviour, changeable at run time through `TieredKVCache.update(policy)` (the router's
                 `PUT /admin/cache-policy` forwards a JSON object of CachePolicy fields to every worker);
                 defined in protocol/cache_policy.py, since the router validates it too, and exported here

Both come from command-line flags (`add_cache_arguments` / `cache_settings_from_args`) or from a JSON or
TOML file of the same names (`--cache-policy-file`); flags given explicitly win over the file.

Write policies (when newly computed full blocks reach the host and Redis tiers):

    write_through  right after prefill (or a decode node's `commit_sequence`), on a background thread
    write_back     only when the device evicts them (to host), and when the host evicts them (to Redis)
    none           never: the lower tiers are only read (filled by other workers, or not at all)

Admission: a block goes to Redis only once it was hit `redis_admission_hits` times in any tier (0: at once),
so one-off prompts do not flood a shared Redis.

Eviction per tier: `device_eviction` and `host_eviction` pick lru or lfu. Redis evicts by its own
`maxmemory-policy` (set allkeys-lru or allkeys-lfu on the server: a client cannot choose per key) and by
`redis_ttl_s`, which every hit refreshes (GETEX, Redis >= 6.2), so the TTL is a sliding idle limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.protocol.cache_policy import CachePolicy, known_fields, positive_number

__all__ = ["GIB", "CachePolicy", "TierConfig", "add_cache_arguments", "cache_argv", "cache_settings_from_args",
           "load_cache_file"]  # CachePolicy with them: callers take it together with TierConfig
GIB = 1 << 30
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


def redis_url_scheme(url: str) -> str:
    """The scheme of a Redis URL this project connects to; ValueError naming the URL otherwise."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ValueError(f"Redis URL {url!r} has no scheme (redis://host:port)")
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"unsupported Redis URL scheme {scheme!r} in {url!r}; use one of {list(REDIS_SCHEMES)}")
    return scheme


@dataclass(frozen=True)
class TierConfig:
    host_capacity_gb: float = 0.0  # 0: no host tier
    redis_url: str | None = None  # redis://, rediss://, unix://, redis+cluster://, redis+sentinel://
    pin_host_memory: bool = False  # page-locked host tier (set when the KV pool is on CUDA)
    redis_socket_timeout_s: float = 2.0  # one Redis call; a lookup's own deadline is the policy's
    redis_retry_interval_s: float = 1.0  # after an error, Redis is skipped (misses) for this long
    redis_batch_blocks: int = 16  # blocks per pipelined round trip (see benchmarks/redis_granularity.py)
    redis_io_threads: int = 4
    max_pending_write_bytes: int = 1 * GIB  # queued write-through/write-back copies; beyond: dropped
    max_fetch_blocks: int = 4096  # blocks staged in host memory by one request's lookup

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            redis_url_scheme(self.redis_url)
        if not (isinstance(self.host_capacity_gb, (int, float)) and self.host_capacity_gb >= 0):
            raise ValueError(f"host_capacity_gb must be >= 0, got {self.host_capacity_gb!r}")
        for name in ("redis_socket_timeout_s", "redis_retry_interval_s"):
            if not positive_number(getattr(self, name)):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("redis_batch_blocks", "redis_io_threads", "max_pending_write_bytes", "max_fetch_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def host_capacity_bytes(self) -> int:
        return int(self.host_capacity_gb * GIB)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TierConfig:
        return cls(**known_fields(cls, data, "cache tier config"))


def load_cache_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A JSON or TOML file → (TierConfig fields, CachePolicy fields); the two share one flat namespace."""
    path = Path(path)
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    if not isinstance(data, dict):
        raise TypeError(f"{path}: expected an object of cache settings, got {type(data).__name__}")
    tier_names = {f.name for f in dataclasses.fields(TierConfig)}
    policy_names = {f.name for f in dataclasses.fields(CachePolicy)}
    unknown = sorted(set(data) - tier_names - policy_names)
    if unknown:
        raise ValueError(f"{path}: unknown cache settings {unknown}")
    return ({k: v for k, v in data.items() if k in tier_names}, {k: v for k, v in data.items() if k in policy_names})


# ---- command line ---------------------------------------------------------------------------------------

_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {  # setting -> (flag, type, help)
    "host_capacity_gb": ("--host-cache-gb", float, "host (pinned RAM) KV tier size in GiB; 0: none"),
    "redis_url": ("--redis-url", str, ("Redis KV tier: redis://, rediss://, unix://, redis+cluster://h:p, "
                                       "redis+sentinel://h:p[,h:p]/service[/db]")),
    "redis_ttl_s": ("--redis-ttl", int, "seconds a block stays in Redis, refreshed on each hit; 0: no expiry"),
    "device_eviction": ("--device-eviction", str, "device tier eviction: lru | lfu"),
    "host_eviction": ("--host-eviction", str, "host tier eviction: lru | lfu"),
    "write": ("--cache-write-policy", str, "write_through | write_back | none"),
    "redis_admission_hits": ("--redis-admission-hits", int, "hits before a block is written to Redis"),
    "lookup_timeout_s": ("--cache-timeout", float, "seconds a request waits for host/Redis lookups"),
}


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache tiers (host RAM, Redis)")
    defaults = TierConfig().__dict__ | CachePolicy().__dict__
    for name, (flag, kind, text) in _FLAGS.items():  # dest from the flag's name: PDSERVE_CACHE_WRITE_POLICY ...
        shown = {None: "none", 24 * 3600: "86400 (a day)"}.get(defaults[name], defaults[name])
        group.add_argument(flag, type=kind, default=None, help=f"{text} (default: {shown}, or the policy file's)")
    group.add_argument("--cache-policy-file", default=None,
                       help="JSON or TOML file of the settings above (default: none)")


def cache_settings_from_args(args: argparse.Namespace, pin_host_memory: bool) -> tuple[TierConfig, CachePolicy]:
    """File first, then explicit flags on top; `pin_host_memory` comes from the worker's device."""
    tier, policy = load_cache_file(args.cache_policy_file) if args.cache_policy_file else ({}, {})
    tier_names = {f.name for f in dataclasses.fields(TierConfig)}
    for name, (flag, _, _) in _FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if name == "redis_ttl_s" and value == 0:
            policy[name] = None
        elif value is not None:
            (tier if name in tier_names else policy)[name] = value
    tier.setdefault("pin_host_memory", pin_host_memory)
    return TierConfig.from_dict(tier), CachePolicy.from_dict(policy)


def cache_argv(args: argparse.Namespace) -> list[str]:
    """The cache flags given in `args`, as command-line words (`pdserve serve` passes them to its workers)."""
    argv: list[str] = []
    for flag, _, _ in _FLAGS.values():
        value = getattr(args, _dest(flag), None)
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "cache_policy_file", None):
        argv += ["--cache-policy-file", str(args.cache_policy_file)]
    return argv


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
