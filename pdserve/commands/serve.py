"""`pdserve serve`: router + prefill and decode workers on this machine, as separate processes.

With no arguments: the router on http://127.0.0.1:8000, one prefill and one decode worker, the default model.
`--colocated` runs one `--role both` worker instead (one block pool, `local` transfer: the baseline).
Model, KV-cache, batching and cache-tier flags (`--redis-url`, `--host-cache-gb`, ...) are passed to every
worker (and the model flags to the router, which needs the tokenizer). Ctrl-C or SIGTERM stops every process.
Every process binds 127.0.0.1 unless --host says otherwise, and the internal API and KV transfer ports need the
shared secret PDSERVE_SECRET, generated here when unset and handed to the children by environment.
"""

from __future__ import annotations

import argparse
import os
import secrets

from pdserve.cache_store.policy import add_cache_arguments, cache_argv
from pdserve.settings import TRANSFER_BACKENDS, LaunchSettings, add_engine_arguments, add_model_arguments

_MODEL_FLAGS = ("model", "load_format", "model_preset", "tokenizer", "max_model_len")
_WORKER_ONLY_FLAGS = ("device", "dtype", "torch_threads", "enforce_eager", "num_blocks", "kv_cache_memory",
                      "gpu_memory_utilization",
                      "block_size", "max_num_seqs",
                      "max_num_batched_tokens", "kv_lease_timeout", "kv_load_failure_policy", "max_queued_requests")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="router + prefill + decode workers on this machine",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--colocated", action="store_true",
                        help="one worker serving both roles over one block pool (the baseline)")
    parser.add_argument("--num-colocated", type=int, default=1,
                        help="with --colocated: that many colocated workers behind the router, each a full replica "
                             "over its own pool, spread over the GPUs (the baseline for N GPUs)")
    parser.add_argument("--num-routers", type=int, default=1,
                        help="routers (default 1): the first on --port, the others on free ports; every worker "
                             "registers with each, and their prefix indexes stay in step")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for every process to answer /health")
    parser.add_argument("--api-key", default=None,
                        help="the router's --api-key (clients send 'Authorization: Bearer <key>'); PDSERVE_API_KEY "
                             "in the environment does the same without showing it to ps")
    parser.add_argument("--transfer-backend", default="auto",
                        choices=[b for b in TRANSFER_BACKENDS if b != "local"],
                        help="how KV moves from prefill to decode workers: auto is cuda_ipc when they run on this "
                             "host's GPUs (P writes into D's pool), tcp otherwise")
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_cache_arguments(parser)
    parser.set_defaults(func=run)


def forwarded_flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The flags among `names` that differ from their defaults, as command-line words."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is None or value == _DEFAULTS.get(name):
            continue
        flag = f"--{name.replace('_', '-')}"
        out += [flag] if value is True else [flag, str(value)]  # an on/off flag takes no value
    return out


def _defaults() -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_engine_arguments(parser)
    return vars(parser.parse_args([]))


_DEFAULTS = _defaults()


def child_environment(environ: dict[str, str], api_key: str | None) -> dict[str, str]:
    """The children's environment: ours, plus the internal API's shared secret (PDSERVE_SECRET: kept when set,
    else a fresh random one, so /internal/* and the KV transfer ports of this deployment refuse strangers) and
    the router's API key. Secrets travel by environment: `ps` shows command lines to every local user."""
    env = dict(environ)
    env["PDSERVE_SECRET"] = env.get("PDSERVE_SECRET") or secrets.token_hex(16)
    if api_key:
        env["PDSERVE_API_KEY"] = api_key
    return env


def run(args: argparse.Namespace) -> int:
    from pdserve.launcher import run_launcher

    try:
        settings = _settings(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve serve: {exc}") from None
    return run_launcher(settings, child_environment(dict(os.environ), args.api_key))


def _settings(args: argparse.Namespace) -> LaunchSettings:
    return LaunchSettings(
        host=args.host, port=args.port, num_prefill=args.num_prefill, num_decode=args.num_decode,
        colocated=args.colocated, num_colocated=args.num_colocated, num_routers=args.num_routers,
        ready_timeout_s=args.ready_timeout,
        worker_args=tuple(forwarded_flags(args, _MODEL_FLAGS + _WORKER_ONLY_FLAGS) + cache_argv(args)),
        router_args=tuple(forwarded_flags(args, _MODEL_FLAGS)), transfer_backend=args.transfer_backend,
    )
