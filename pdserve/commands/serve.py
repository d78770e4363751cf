"""`pdserve serve [MODEL]`: router + prefill and decode workers on this machine, as separate processes.

With no arguments: the router on http://127.0.0.1:8000, one prefill and one decode worker, the default model.
`--colocated` runs one `--role both` worker instead (one block pool, `local` transfer: the baseline).
Model, KV-cache, batching and cache-tier flags (`--redis-url`, `--host-cache-gb`, ...) are passed to every
worker (and the model flags to the router, which needs the tokenizer); the router flags (policies, tokens,
CORS, TLS, ...) to the router. A child that exits is restarted (--max-restarts per minute; pdserve/launcher.py);
Ctrl-C or SIGTERM stops every process.
Every process binds 127.0.0.1 unless --host says otherwise, and the internal API and KV transfer ports need the
shared secret PDSERVE_SECRET, generated here when unset and handed to the children by environment, as are
--api-key and --admin-token (PDSERVE_API_KEY, PDSERVE_ADMIN_TOKEN: `ps` shows command lines, not environments).
"""

from __future__ import annotations

import argparse
import os
import secrets

from pdserve.cache_store.policy import add_cache_arguments, cache_argv
from pdserve.router_flags import SECRET_FLAGS, add_router_arguments, parse_list
from pdserve.settings import TRANSFER_BACKENDS, LaunchSettings
from pdserve.supervision import RestartPolicy
from pdserve.worker.flags import (
    add_engine_arguments,
    add_log_arguments,
    add_model_arguments,
    add_transfer_store_arguments,
)

# what the router needs of the model (it loads the tokenizer and config), and the log level: to every process
_MODEL_FLAGS = ("model", "revision", "download_dir", "served_model_name", "load_format", "model_preset",
                "tokenizer", "max_model_len", "block_size", "log_level")
_WORKER_ONLY_FLAGS = ("device", "dtype", "kv_cache_dtype", "calculate_kv_scales", "quantization", "seed", "torch_threads", "enforce_eager", "num_blocks",
                      "kv_cache_memory", "gpu_memory_utilization", "enable_prefix_caching", "decode_prefix_cache", "max_num_seqs",
                      "max_num_batched_tokens", "kv_lease_timeout", "kv_load_failure_policy", "max_queued_requests",
                      "async_scheduling", "transfer_store", "transfer_store_dir", "transfer_chunk_size")
_ROUTER_ONLY_FLAGS = ("prefill_policy", "cache_aware_max_imbalance", "decode_policy", "local_prefill_threshold",
                      "busy_local_prefill_tokens", "busy_prefill_backlog", "heartbeat_interval",
                      "heartbeat_timeout", "reserve_timeout", "stream_stall_timeout", "status_window",
                      "max_body_size", "max_inflight_requests", "chat_template", "tool_call_parser",
                      "disable_log_requests", "disable_log_stats", "log_stats_interval", "allowed_origins", "allowed_methods",
                      "allowed_headers", "allow_credentials", "ssl_keyfile", "ssl_certfile")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="router + prefill + decode workers on this machine",
                                   description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    parser.set_defaults(func=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address every process binds (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="the router's HTTP port (the API)")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers")
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
    parser.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                        help="restarts of one child (a worker or a router that exited) within a minute, each after "
                             "a backoff (0.5 s, doubling); past it the child is given up, and with no router or no "
                             "worker of a role left, serve exits 1; 0: never restart")
    parser.add_argument("--transfer-backend", default="auto",
                        choices=[b for b in TRANSFER_BACKENDS if b != "local"],
                        help="how KV moves from prefill to decode workers: auto is cuda_ipc when they run on this "
                             "host's GPUs (P writes into D's pool), tcp otherwise; store: through --transfer-store")
    add_transfer_store_arguments(parser)
    add_log_arguments(parser)
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_cache_arguments(parser)
    add_router_arguments(parser, internal_port=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    return parser


_ACTIONS = {action.dest: action for action in _parser()._actions if action.option_strings}
_DEFAULTS = {dest: action.default for dest, action in _ACTIONS.items()}


def forwarded_flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The flags among `names` that differ from their defaults, as command-line words."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is None or value == _DEFAULTS.get(name):
            continue
        action = _ACTIONS[name]
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):  # on/off: --flag, or --no-flag for one that is on by default
            out += [flag] if value else [f"--no-{name.replace('_', '-')}"]
        elif action.type is parse_list:
            out += [flag, ",".join(value)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def child_environment(environ: dict[str, str], api_key: str | None, admin_token: str | None = None) -> dict[str, str]:
    """The children's environment: ours, plus the internal API's shared secret (PDSERVE_SECRET: kept when set,
    else a fresh random one, so /internal/* and the KV transfer ports of this deployment refuse strangers) and
    the router's API key and admin token. Secrets travel by environment: `ps` shows command lines to every
    local user."""
    env = dict(environ)
    env["PDSERVE_SECRET"] = env.get("PDSERVE_SECRET") or secrets.token_hex(16)
    for variable, value in ((SECRET_FLAGS["api_key"], api_key), (SECRET_FLAGS["admin_token"], admin_token)):
        if value:
            env[variable] = value
    return env


def run(args: argparse.Namespace) -> int:
    from pdserve.launcher import run_launcher

    try:
        settings = _settings(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve serve: {exc}") from None
    return run_launcher(settings, child_environment(dict(os.environ), args.api_key, args.admin_token))


def _settings(args: argparse.Namespace) -> LaunchSettings:
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError(f"TLS needs both --ssl-keyfile and --ssl-certfile, got {args.ssl_keyfile} and "
                         f"{args.ssl_certfile}")
    model_flags = forwarded_flags(args, _MODEL_FLAGS)
    return LaunchSettings(
        host=args.host, port=args.port, num_prefill=args.num_prefill, num_decode=args.num_decode,
        colocated=args.colocated, num_colocated=args.num_colocated, num_routers=args.num_routers,
        ready_timeout_s=args.ready_timeout,
        worker_args=tuple(model_flags + forwarded_flags(args, _WORKER_ONLY_FLAGS) + cache_argv(args)),
        router_args=tuple(model_flags + forwarded_flags(args, _ROUTER_ONLY_FLAGS)),
        transfer_backend=args.transfer_backend, router_tls=args.ssl_certfile is not None,
        restart=RestartPolicy(max_restarts=args.max_restarts),
    )
