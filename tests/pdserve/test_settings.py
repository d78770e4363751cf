"""Typed settings: validation with the offending values, flags → settings, KV pool sizing."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cache_store.policy import TierConfig
from pdserve.router.config import RouterConfig
from pdserve.router_server import ListenSettings
from pdserve.settings import (
    KVCacheSettings,
    LaunchSettings,
    ModelSettings,
    SchedulerSettings,
    ServerSettings,
    WorkerSettings,
    parse_roles,
    parse_size,
)
from pdserve.worker.flags import add_worker_arguments, worker_settings_from_args


def test_sizes_and_roles() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512m") == 512 << 20 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="'lots'"):
        parse_size("lots")
    assert parse_roles("both") == ("prefill", "decode") and parse_roles("decode") == ("decode",)
    with pytest.raises(ValueError, match="'router'"):
        parse_roles("router")


def test_validation_names_the_values() -> None:
    with pytest.raises(ValueError, match="--num-blocks \\(10\\).*--kv-cache-memory \\(5 bytes\\)"):
        KVCacheSettings(num_blocks=10, kv_cache_memory=5)
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        SchedulerSettings(max_num_seqs=0)
    with pytest.raises(ValueError, match="'localhost:8000'"):
        ServerSettings(router_url="localhost:8000")
    with pytest.raises(ValueError, match="needs --role both"):
        WorkerSettings(roles=("decode",), transfer=WorkerSettings(roles=("prefill", "decode")).transfer)
    # each of these reached a traceback (ZeroDivisionError, OverflowError at bind, ...) before it was checked here
    with pytest.raises(ValueError, match="--block-size must be a power of two, got 0"):
        KVCacheSettings(block_size=0)
    with pytest.raises(ValueError, match="--block-size must be a power of two, got 24"):
        KVCacheSettings(block_size=24)
    with pytest.raises(ValueError, match=r"--port must be in \[0, 65535\], got 70000"):
        LaunchSettings(port=70000)
    with pytest.raises(ValueError, match="--ready-timeout must be positive, got -5"):
        LaunchSettings(ready_timeout_s=-5)
    with pytest.raises(ValueError, match="--torch-threads must be >= 1, got 0"):
        ModelSettings(torch_threads=0)
    with pytest.raises(ValueError, match=r"--internal-port must be in \[0, 65535\], got -1"):
        ListenSettings(internal_port=-1, ssl_keyfile="k", ssl_certfile="c")
    with pytest.raises(ValueError, match="Redis URL 'cache:6379' has no scheme"):
        TierConfig(redis_url="cache:6379")
    with pytest.raises(ValueError, match="unsupported Redis URL scheme 'http'"):
        TierConfig(redis_url="http://cache:6379")
    assert TierConfig(redis_url="redis+sentinel://a:26379,b:26379/main").redis_url is not None
    with pytest.raises(ValueError, match="--block-size must be a power of two, got 24"):
        RouterConfig(model="m", block_size=24)
    with pytest.raises(ValueError, match=r"served model names must not be empty, got \['m', ''\]"):
        RouterConfig(model="m", extra_models=("",))


def test_transfer_backend_follows_the_roles() -> None:
    assert WorkerSettings(roles=("prefill", "decode")).transfer.backend == "local"
    assert WorkerSettings(roles=("prefill",)).transfer.backend == "tcp"


def test_kv_pool_size_from_count_budget_or_device_memory() -> None:
    per_block = 16 * 46080  # SmolLM2-135M fp32: 46 KB per token
    assert KVCacheSettings(num_blocks=100).resolve_num_blocks(per_block) == 100
    assert KVCacheSettings(kv_cache_memory=per_block * 7 + 1).resolve_num_blocks(per_block) == 7
    assert KVCacheSettings().resolve_num_blocks(per_block) == (1 << 30) // per_block  # CPU: 1 GiB
    # CUDA: the budget engine/kv_cache.gpu_kv_budget computed (tests/engine/test_kv_budget.py)
    assert KVCacheSettings().resolve_num_blocks(1 << 20, device_budget=6 << 30) == 6144
    assert KVCacheSettings(num_blocks=5).resolve_num_blocks(1 << 20, device_budget=6 << 30) == 5
    assert not KVCacheSettings().sized_explicitly and KVCacheSettings(num_blocks=5).sized_explicitly
    with pytest.raises(ValueError, match="holds no block"):
        KVCacheSettings(kv_cache_memory=10).resolve_num_blocks(per_block)


def test_worker_flags_become_settings() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, role="decode")
    args = parser.parse_args(["--port", "9001", "--transfer-port", "9002", "--kv-cache-memory", "512MiB",
                              "--max-num-seqs", "8", "--router", "http://10.0.0.1:8000", "--dtype", "bfloat16"])
    settings = worker_settings_from_args(args, cache_dir="/tmp/models", secret="s")
    assert settings.roles == ("decode",) and settings.role_name == "decode"
    assert settings.cache.kv_cache_memory == 512 << 20 and settings.scheduler.max_num_seqs == 8
    assert (settings.server.port, settings.transfer.port, settings.transfer.backend) == (9001, 9002, "tcp")
    assert settings.server.router_url == "http://10.0.0.1:8000" and settings.server.secret == "s"
    assert settings.model.dtype == "bfloat16" and settings.model.cache_dir == "/tmp/models"
    assert not settings.model.enforce_eager and settings.cache.gpu_memory_utilization == 0.8
    tuned = worker_settings_from_args(parser.parse_args(["--enforce-eager", "--gpu-memory-utilization", "0.45"]),
                                      None, None)
    assert tuned.model.enforce_eager and tuned.cache.gpu_memory_utilization == 0.45
    both = worker_settings_from_args(parser.parse_args(["--role", "both"]), None, None)
    assert both.colocated and both.transfer.backend == "local"


def test_several_routers() -> None:
    server = ServerSettings(router_url="http://10.0.0.1:8000/, http://routers:8000", router_resolve_interval_s=2)
    assert server.router_urls == ("http://10.0.0.1:8000", "http://routers:8000")
    assert ServerSettings().router_urls == ()
    with pytest.raises(ValueError, match="'routers:8000' in"):
        ServerSettings(router_url="http://a:1,routers:8000")
    with pytest.raises(ValueError, match="names no URL"):
        ServerSettings(router_url=" , ")
    with pytest.raises(ValueError, match="router_resolve_interval_s must be positive, got 0"):
        ServerSettings(router_resolve_interval_s=0)
