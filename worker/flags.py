"""Command-line flags of the model, the KV cache and the worker, shared by `pdserve prefill`, `pdserve decode`,
`pdserve serve` (which passes them on) and, for the model's source, `pdserve router`; and the settings
(pdserve/settings.py) they build. Flag names follow `vllm serve` where the two mean the same (docs/configuration.md
has the table). Nothing here reads the environment: the command modules pass `cache_dir` and `secret` in."""

from __future__ import annotations

import argparse

from pdserve.cache_store.policy import add_cache_arguments, cache_settings_from_args
from pdserve.settings import (
    DEFAULT_MODEL,
    DTYPES,
    GPU_MAX_NUM_SEQS,
    KV_CACHE_DTYPE_FLAGS,
    KV_LOAD_FAILURE_POLICIES,
    LOAD_FORMATS,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
    TRANSFER_BACKENDS,
    TRANSFER_STORES,
    FaultSettings,
    KVCacheSettings,
    ModelSettings,
    SchedulerSettings,
    ServerSettings,
    TransferSettings,
    WorkerSettings,
    canonical_kv_cache_dtype,
    parse_roles,
    parse_size,
)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_model_source_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """What the model is and what it is called: the router needs these as much as the workers."""
    group = parser.add_argument_group("model")
    group.add_argument("model", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                       help="the model, as --model (`pdserve serve MODEL` as `vllm serve MODEL`); wins over --model")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="embedded model name, Hugging Face repo id (org/name: the local hub cache, else a "
                            "download), .gguf file or Hugging Face directory")
    group.add_argument("--revision", default=None,
                       help="branch, tag or commit of a repo id (default: main)")
    group.add_argument("--download-dir", default=None, metavar="DIR",
                       help="Hugging Face cache that repo ids are read from and downloaded into (default: "
                            "huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the names clients give as `model`, the first one reported (default: the model's own: "
                            "the repo id, embedded name, or file / directory name)")
    group.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                       help="auto: from the model (embedded name, repo id, .gguf file, HF directory); "
                            "dummy: random weights of --model-preset's shapes")
    group.add_argument("--model-preset", default=None,
                       help="shapes for --load-format dummy, e.g. llama3-8b (default: the preset of --model)")
    group.add_argument("--tokenizer", default=None,
                       help="directory with tokenizer.json (default: the model's; dummy weights have none)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="cap on prompt + output tokens (default: the model's)")
    return group


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = add_model_source_arguments(parser)
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ...; auto: cuda if available")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weights and KV dtype; auto: bfloat16 on CUDA, float32 on CPU")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_FLAGS,
                       help="KV pool dtype; auto: --dtype; fp8 (or fp8_e4m3, as SGLang names it): float8_e4m3fn, "
                            "half the bytes of bf16, with the checkpoint's per-layer k/v scales or 1.0 "
                            "(docs/quantization.md); P and D must agree")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="with --kv-cache-dtype fp8: compute the per-layer k/v scales once at start from a "
                            "built-in text (every worker gets the same ones), instead of the checkpoint's or 1.0")
    group.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    group.add_argument("--seed", type=int, default=ModelSettings.seed,
                       help="seed of the worker's random generator (sampling of requests without their own "
                            "`seed`) and of --load-format dummy's weights")
    group.add_argument("--torch-threads", type=int, default=None,
                       help="CPU threads per worker (default: torch's, one per core; use 1 when several "
                            "workers share few cores)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run decode steps eagerly instead of replaying one CUDA graph per batch bucket "
                            "(CUDA only; CPU always runs eagerly)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV cache and batching")
    size = group.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None,
                      help="KV blocks in the pool (default: from --kv-cache-memory, --gpu-memory-utilization on "
                           "CUDA, 1 GiB on CPU)")
    size.add_argument("--kv-cache-memory", type=parse_size, default=None,
                      help="KV pool size, e.g. 2GiB (default: see --num-blocks)")
    group.add_argument("--gpu-memory-utilization", type=float, default=KVCacheSettings.gpu_memory_utilization,
                       help="without --num-blocks/--kv-cache-memory on CUDA: the share of the GPU's memory this "
                            "worker may fill, weights included (workers sharing a GPU take a share each)")
    group.add_argument("--block-size", type=int, default=KVCacheSettings.block_size,
                       help="tokens per KV block (the router and every worker must agree)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=KVCacheSettings.enable_prefix_caching,
                       help="reuse the KV of a prompt's cached prefix (device blocks, and the host / Redis tiers); "
                            "--no-enable-prefix-caching computes every prompt in full")
    group.add_argument("--decode-prefix-cache", action=argparse.BooleanOptionalAction,
                       default=KVCacheSettings.decode_prefix_cache,
                       help="a decode worker reserves a prompt's prefix from the blocks it holds (finished "
                            "sequences: prompt + output), so the prefill worker sends only the rest; "
                            "--no-decode-prefix-cache: every prompt's KV is sent in full")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="sequences in one batch at most: decode's running batch, prompts in one prefill "
                            f"(default: {GPU_MAX_NUM_SEQS} on a GPU, as vLLM's; {SchedulerSettings.max_num_seqs} "
                            "on CPU)")
    group.add_argument("--max-num-batched-tokens", type=int, default=SchedulerSettings.max_num_batched_tokens,
                       help="tokens in one prefill iteration at most (chunked prefill beyond it)")
    group.add_argument("--kv-lease-timeout", type=float, default=SchedulerSettings.kv_lease_timeout_s,
                       help="seconds a decode reservation waits without receiving KV (each KV frame renews it)")
    group.add_argument("--kv-load-failure-policy", default=SchedulerSettings.kv_load_failure_policy,
                       choices=KV_LOAD_FAILURE_POLICIES,
                       help="a decode reservation whose KV did not arrive (lease ran out, prefill worker gone): "
                            "fail the request, or recompute its prompt on the decode worker")
    group.add_argument("--max-queued-requests", type=int, default=SchedulerSettings.max_queued_requests,
                       help="requests a worker holds waiting beyond its running batch; more get 503 + Retry-After")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=SchedulerSettings.async_scheduling,
                       help="decode: plan and launch each step while the previous one runs on the device "
                            "(outputs are the same; --no-async-scheduling runs one step at a time)")
    group.add_argument("--fault-hang-step-after", type=int, default=None,
                       help="TEST ONLY, never in service: the forward after the N-th hangs until the worker stops "
                            "while its event loop runs on, for the router's stall detection tests "
                            "(engine/step_liveness.py; default: none, off)")


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="console log level of the process (vllm's --uvicorn-log-level)")


def add_worker_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--role", default=role, choices=("prefill", "decode", "both"),
                        help="which work the worker admits; both: prefill and decode over one block pool")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    parser.add_argument("--data-port", type=int, default=0,
                        help="port of the data plane: reserve, prefill, abort and token messages from the routers, "
                             "one multiplexed connection per router (0: any free port; sent with the registration)")
    parser.add_argument("--router", default=None,
                        help="router URL(s) to register with, comma-separated, e.g. http://127.0.0.1:8000; a host "
                             "name stands for every address it resolves to (a headless Service: every router) "
                             "(default: none, a static worker the router is given with --prefill / --decode)")
    parser.add_argument("--router-resolve-interval", type=float, default=ServerSettings.router_resolve_interval_s,
                        help="seconds between DNS lookups of --router's host names (routers added or gone)")
    parser.add_argument("--worker-id", default=None,
                        help="name in the router's registry, metrics and admin API (default: generated)")
    parser.add_argument("--advertise-host", default=None,
                        help="host name or IP the router and other workers reach this worker at (default: the IP "
                             "of --host; in a container, its own address)")
    parser.add_argument("--drain-on-sigterm", action="store_true",
                        help="on SIGTERM, take no new work, finish the requests held, deregister, then exit "
                             "(a second SIGTERM stops at once)")
    parser.add_argument("--transfer-backend", default="auto", choices=TRANSFER_BACKENDS,
                        help="how KV moves P → D: auto is local for --role both, tcp otherwise; cuda_ipc: P writes "
                             "into D's GPU pool (one host); nccl: control on tcp, bytes through torch.distributed; "
                             "store: P writes into a store both pools reach, D loads from it (--transfer-store)")
    parser.add_argument("--transfer-host", default=None, help="address of the KV receiver (default: --host)")
    parser.add_argument("--transfer-port", type=int, default=0, help="KV receiver port (0: any free port)")
    add_transfer_store_arguments(parser)
    add_log_arguments(parser)
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_cache_arguments(parser)


def add_transfer_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The `store` backend's flags (docs/kv_cache.md: when to choose it)."""
    parser.add_argument("--transfer-store", default=TransferSettings.store, choices=TRANSFER_STORES,
                        help="with --transfer-backend store: shm (a tmpfs directory: workers of this host), redis "
                             "(--redis-url: any hosts); auto: redis when --redis-url is given, else shm")
    parser.add_argument("--transfer-store-dir", default=TransferSettings.store_dir,
                        help="the shm transfer store's directory (every worker of the host gives the same one)")
    parser.add_argument("--transfer-chunk-size", type=parse_size, default=TransferSettings.chunk_bytes,
                        help="largest value of the store transfer, e.g. 4MiB: a layer's blocks go in values of at "
                             "most this size")


def model_settings_from_args(args: argparse.Namespace, cache_dir: str | None) -> ModelSettings:
    return ModelSettings(model=args.model, load_format=args.load_format, model_preset=args.model_preset,
                         tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                         kv_cache_dtype=canonical_kv_cache_dtype(args.kv_cache_dtype),
                         calculate_kv_scales=args.calculate_kv_scales,
                         quantization=args.quantization,
                         cache_dir=cache_dir,
                         max_model_len=args.max_model_len, seed=args.seed, torch_threads=args.torch_threads,
                         enforce_eager=args.enforce_eager, revision=args.revision, download_dir=args.download_dir,
                         served_model_names=tuple(args.served_model_name or ()))


def worker_settings_from_args(args: argparse.Namespace, cache_dir: str | None,
                              secret: str | None) -> WorkerSettings:
    """`cache_dir` and `secret` come from the environment, which only the command module reads."""
    tiers, cache_policy = cache_settings_from_args(args, pin_host_memory=_uses_cuda(args.device))
    return WorkerSettings(
        roles=parse_roles(args.role),
        model=model_settings_from_args(args, cache_dir),
        cache=KVCacheSettings(num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
                              block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                              enable_prefix_caching=args.enable_prefix_caching,
                              decode_prefix_cache=args.decode_prefix_cache),
        scheduler=SchedulerSettings(max_num_seqs=_max_num_seqs(args),
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_lease_timeout_s=args.kv_lease_timeout,
                                    kv_load_failure_policy=args.kv_load_failure_policy,
                                    max_queued_requests=args.max_queued_requests,
                                    async_scheduling=args.async_scheduling),
        transfer=TransferSettings(backend=args.transfer_backend, host=args.transfer_host or args.host,
                                  port=args.transfer_port, store=args.transfer_store,
                                  store_dir=args.transfer_store_dir, chunk_bytes=args.transfer_chunk_size),
        server=ServerSettings(host=args.host, port=args.port, data_port=args.data_port, router_url=args.router,
                              router_resolve_interval_s=args.router_resolve_interval, secret=secret,
                              worker_id=args.worker_id, advertise_host=args.advertise_host,
                              drain_on_sigterm=args.drain_on_sigterm, log_level=args.log_level),
        tiers=tiers, cache_policy=cache_policy, faults=FaultSettings(hang_step_after=args.fault_hang_step_after),
    )


def _max_num_seqs(args: argparse.Namespace) -> int:
    if args.max_num_seqs is not None:
        return int(args.max_num_seqs)
    return GPU_MAX_NUM_SEQS if _uses_cuda(args.device) else SchedulerSettings.max_num_seqs


def _uses_cuda(device: str) -> bool:
    """Whether the KV pool will live on a GPU (then the host tier is pinned: DMA straight to the device)."""
    if device == "auto":
        import torch  # only here: settings stay light for the router

        return bool(torch.cuda.is_available())
    return device.startswith("cuda")
