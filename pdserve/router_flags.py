"""The router's own flags (policies, tokens, limits, CORS, TLS, request logging), shared by `pdserve router` and
`pdserve serve`, which passes them on to the router it starts; and the RouterConfig they build.

Names as `vllm serve`'s where the two mean the same: --api-key, --allowed-origins, --allowed-methods,
--allowed-headers, --allow-credentials, --ssl-keyfile, --ssl-certfile, --chat-template, --disable-log-requests,
--disable-log-stats.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.router.config import RouterConfig
from pdserve.router.cors import CorsSettings
from pdserve.router.policies import DECODE_POLICIES, PREFILL_POLICIES
from pdserve.settings import parse_size

# the flags whose values are secrets: `pdserve serve` hands them to the router by environment, not argv
SECRET_FLAGS = {"admin_token": "PDSERVE_ADMIN_TOKEN", "api_key": "PDSERVE_API_KEY"}


def parse_list(text: str) -> list[str]:
    """A JSON list (vllm's form: '["https://a.example"]') or comma-separated words."""
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def add_router_arguments(parser: argparse.ArgumentParser, internal_port: bool = True) -> None:
    """`internal_port`: offer --internal-port (`pdserve serve` chooses that port itself)."""
    defaults = RouterConfig(model="-")
    group = parser.add_argument_group("router")
    group.add_argument("--prefill-policy", default=defaults.prefill_policy, choices=sorted(PREFILL_POLICIES),
                       help="how a prefill worker is chosen")
    group.add_argument("--cache-aware-max-imbalance", type=int, default=defaults.cache_aware_max_imbalance,
                       help="cache_aware: queued requests a P may have beyond the least loaded one and still get "
                            "the prompts whose prefix it holds")
    group.add_argument("--decode-policy", default=defaults.decode_policy, choices=sorted(DECODE_POLICIES),
                       help="how a decode worker is chosen")
    group.add_argument("--local-prefill-threshold", type=int, default=defaults.local_prefill_threshold,
                       help="conditional disaggregation: a request whose uncached suffix on a decode worker that "
                            "holds part of it (an earlier turn) is shorter than this many tokens is prefilled by that "
                            "decode worker, with no prefill worker and no KV transfer; 0: never (a fresh prompt: "
                            "--busy-local-prefill-tokens)")
    group.add_argument("--busy-local-prefill-tokens", type=int, default=defaults.busy_local_prefill_tokens,
                       help="conditional disaggregation while the prefill pool is short of a worker: a fresh prompt "
                            "shorter than this many tokens is prefilled by a decode worker when every prefill worker "
                            "left already has --busy-prefill-backlog prompt tokens in prefill by the router's count "
                            "(or none is up); it then runs inside one of that worker's decode steps, as a "
                            "--local-prefill-threshold prefill does; 0: never")
    group.add_argument("--busy-prefill-backlog", type=int, default=defaults.busy_prefill_backlog,
                       help="prompt tokens in prefill on a prefill worker from which it counts as busy for "
                            "--busy-local-prefill-tokens (default: one forward at the default "
                            "--max-num-batched-tokens)")
    group.add_argument("--heartbeat-interval", type=float, default=defaults.heartbeat_interval_s,
                       help="seconds between a worker's heartbeats (told to workers at registration)")
    group.add_argument("--heartbeat-timeout", type=float, default=None,
                       help="seconds of silence after which a worker is dropped (default: 3 x --heartbeat-interval)")
    group.add_argument("--reserve-timeout", type=float, default=defaults.reserve_timeout_s,
                       help="seconds a decode worker has to answer a reservation before the next one is asked "
                            "(and it takes no new work until its next heartbeat)")
    group.add_argument("--stream-stall-timeout", type=float, default=defaults.stream_stall_timeout_s,
                       help="seconds a worker's data-plane link may stay silent (it is pinged every quarter of "
                            "this), or its model steps may make no progress while it heartbeats, before its "
                            "requests end with an error and it is skipped as stalled")
    group.add_argument("--admin-token", default=None,
                       help="bearer token of the /admin API (workers, drain, roles, policies); best given as "
                            "PDSERVE_ADMIN_TOKEN, which ps does not show (default: none, admin API off)")
    group.add_argument("--api-key", default=None,
                       help="clients must send 'Authorization: Bearer <key>' on /v1/* (as vllm serve's --api-key); "
                            "best given as PDSERVE_API_KEY, which ps does not show (default: none, open)")
    group.add_argument("--status-window", type=float, default=defaults.status_window_s,
                       help="seconds of finished requests behind the /status page's percentiles")
    group.add_argument("--max-body-size", type=parse_size, default=defaults.max_body_bytes,
                       help="largest request body, e.g. 32MiB; larger ones get 413")
    group.add_argument("--max-inflight-requests", type=int, default=defaults.max_inflight_requests,
                       help="completions answered at once; more get 429 with Retry-After")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="Jinja chat template for /v1/chat/completions: a file, or the template itself on one "
                            "line (default: the model's)")
    group.add_argument("--tool-call-parser", default=defaults.tool_call_parser, choices=["hermes"],
                       help="how tool calls are read from the output of tool_choice 'auto' (as vllm serve's flag; "
                            "hermes: <tool_call>{...}</tool_call>, the default model's format)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="no INFO line per finished request (id, prompt / output / cached tokens, TTFT, E2E, "
                            "status)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no stats line per pool (throughput, running, waiting, KV usage, prefix hit rate) every "
                            "--log-stats-interval while busy")
    group.add_argument("--log-stats-interval", type=float, default=defaults.log_stats_interval_s,
                       help="seconds between the stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)")
    _add_http_arguments(parser, internal_port)


def _add_http_arguments(parser: argparse.ArgumentParser, internal_port: bool) -> None:
    group = parser.add_argument_group("router HTTP: CORS and TLS")
    group.add_argument("--allowed-origins", type=parse_list, default=[],
                       help="origins browsers may call the API from, e.g. '[\"https://app.example\"]' or "
                            "https://a,https://b; '*': any (default: none, no CORS headers; vllm allows any)")
    group.add_argument("--allowed-methods", type=parse_list, default=["*"], help="CORS: methods allowed")
    group.add_argument("--allowed-headers", type=parse_list, default=["*"], help="CORS: request headers allowed")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    group.add_argument("--ssl-keyfile", default=None,
                       help="TLS private key (PEM): the router answers https (default: none, plain http)")
    group.add_argument("--ssl-certfile", default=None,
                       help="TLS certificate chain (PEM), with --ssl-keyfile (default: none)")
    if not internal_port:
        return
    group.add_argument("--internal-port", type=int, default=None,
                       help="with TLS: also listen on plain http on 127.0.0.1 at this port, for the workers of "
                            "this host (`pdserve serve` sets it; default: none)")
    group.add_argument("--fd", type=int, default=None,
                       help="serve on this inherited listening socket, bound to --host/--port by the parent "
                            "(`pdserve serve` passes its own, so a restarted router keeps the port; default: bind)")
    group.add_argument("--internal-fd", type=int, default=None,
                       help="the same for the --internal-port listener (default: bind)")


def cors_from_args(args: argparse.Namespace) -> CorsSettings:
    return CorsSettings(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                        args.allow_credentials)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a template (holds '{{' or '{%')."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise SystemExit(f"--chat-template {value}: no such file (give a Jinja file, or the template itself)")
    return path.read_text()


def router_config(args: argparse.Namespace, name: str, aliases: tuple[str, ...], max_model_len: int,
                  secret: str | None) -> RouterConfig:
    """`secret` comes from the environment, which only the command module reads."""
    return RouterConfig(
        model=name, extra_models=aliases, max_model_len=max_model_len, block_size=args.block_size,
        prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), secret=secret,
        heartbeat_interval_s=args.heartbeat_interval, heartbeat_timeout_s=args.heartbeat_timeout,
        reserve_timeout_s=args.reserve_timeout, stream_stall_timeout_s=args.stream_stall_timeout,
        admin_token=args.admin_token or None, status_window_s=args.status_window, api_key=args.api_key or None,
        max_body_bytes=args.max_body_size, max_inflight_requests=args.max_inflight_requests,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        cache_aware_max_imbalance=args.cache_aware_max_imbalance, log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats, log_stats_interval_s=args.log_stats_interval,
        local_prefill_threshold=args.local_prefill_threshold,
        busy_local_prefill_tokens=args.busy_local_prefill_tokens, busy_prefill_backlog=args.busy_prefill_backlog,
        tool_call_parser=args.tool_call_parser,
    )
