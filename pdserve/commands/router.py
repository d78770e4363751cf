"""`pdserve router`: the OpenAI-compatible front end. Workers register with it (`--router URL` on their side),
or are listed statically with `--prefill URL` / `--decode URL` (repeatable).

It loads the model's tokenizer and config only, never its weights. Reads PDSERVE_CACHE_DIR and PDSERVE_SECRET
from the environment, and every flag's default from PDSERVE_<FLAG> (pdserve/env_flags.py): --admin-token and
--api-key are best given as PDSERVE_ADMIN_TOKEN and PDSERVE_API_KEY, which `ps` does not show.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdserve.env_flags import apply_env_defaults


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.settings import DEFAULT_MODEL, LOAD_FORMATS, parse_size

    parser = subparsers.add_parser("router", help="start the router (OpenAI API)", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    parser.add_argument("--model-preset", default=None, help="with --load-format dummy")
    parser.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (dummy weights have none)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill", action="append", default=[], metavar="URL", help="a static prefill worker")
    parser.add_argument("--decode", action="append", default=[], metavar="URL", help="a static decode worker")
    parser.add_argument("--prefill-policy", default=None,
                        help="how P is chosen: cache_aware (default), round_robin, least_loaded")
    parser.add_argument("--cache-aware-max-imbalance", type=int, default=None,
                        help="cache_aware: queued requests a P may have beyond the least loaded one and still get "
                             "the prompts whose prefix it holds (default 4)")
    parser.add_argument("--decode-policy", default=None, help="how D is chosen (default: the router's)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=None, help="default: 3 x --heartbeat-interval")
    parser.add_argument("--admin-token", default=None,
                        help="bearer token of the /admin API (workers, drain, roles, policies); unset: admin API off")
    parser.add_argument("--status-window", type=float, default=300.0,
                        help="seconds of finished requests behind the /status page's percentiles")
    parser.add_argument("--api-key", default=None,
                        help="clients must send 'Authorization: Bearer <key>' on /v1/* (as vllm serve's --api-key); "
                             "best given as PDSERVE_API_KEY, which ps does not show")
    parser.add_argument("--max-body-size", type=parse_size, default=32 << 20,
                        help="largest request body, e.g. 32MiB (default); larger ones get 413")
    parser.add_argument("--max-inflight-requests", type=int, default=1024,
                        help="completions answered at once (default 1024); more get 429 with Retry-After")
    apply_env_defaults(parser, os.environ)
    parser.set_defaults(func=run)


def model_facts(model: str, load_format: str, preset: str | None, tokenizer_dir: str | None,
                cache_dir: Path | None) -> tuple[str, object, int]:
    """(served name, tokenizer, max_model_len) without loading any weight."""
    from pdserve.engine.presets import get_preset
    from pdserve.engine.weights import KNOWN_MODELS, ModelSpec, resolve_model
    from pdserve.engine.weights.convert import ensure_converted
    from pdserve.engine.weights.fetch import converted_dir, default_cache_dir, fetch_model
    from pdserve.engine.weights.fingerprint import file_digest
    from pdserve.engine.weights.hf_dir import hf_config
    from pdserve.engine.weights.loader import load_tokenizer
    from pdserve.engine.weights.registry import ModelKind

    name_or_preset = (preset or model) if load_format == "dummy" else model
    resolved = resolve_model(name_or_preset, load_format)
    tokenizer = load_tokenizer(ModelSpec(name_or_preset, load_format, tokenizer=tokenizer_dir), cache_dir)
    if resolved.kind is ModelKind.DUMMY:
        return resolved.name, tokenizer, get_preset(resolved.preset or "").max_model_len
    cache = cache_dir or default_cache_dir()
    if resolved.kind is ModelKind.EMBEDDED:
        path = fetch_model(KNOWN_MODELS[resolved.name], cache)
    elif resolved.kind is ModelKind.GGUF:
        assert resolved.path is not None
        path = ensure_converted(resolved.path, converted_dir(cache, resolved.name, file_digest(resolved.path)),
                                resolved.name)
    else:
        assert resolved.path is not None
        path = resolved.path
    return resolved.name, tokenizer, hf_config(path, resolved.name).max_model_len


def router_config_from_args(args: argparse.Namespace, name: str, max_len: int, secret: str | None):
    """The RouterConfig of parsed flags, for the model `name` of `max_len` tokens (model_facts)."""
    from pdserve.router.config import RouterConfig

    policies = {key: value for key, value in (("prefill_policy", args.prefill_policy),
                                               ("decode_policy", args.decode_policy),
                                               ("cache_aware_max_imbalance", args.cache_aware_max_imbalance))
                if value is not None}
    return RouterConfig(
        model=name, max_model_len=min(max_len, args.max_model_len or max_len), block_size=args.block_size,
        prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), secret=secret,
        heartbeat_interval_s=args.heartbeat_interval, heartbeat_timeout_s=args.heartbeat_timeout,
        admin_token=args.admin_token or None, status_window_s=args.status_window, api_key=args.api_key or None,
        max_body_bytes=args.max_body_size, max_inflight_requests=args.max_inflight_requests, **policies,
    )


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from pdserve.router.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call to a worker otherwise
    cache_dir = os.environ.get("PDSERVE_CACHE_DIR")
    name, tokenizer, max_len = model_facts(args.model, args.load_format, args.model_preset, args.tokenizer,
                                           Path(cache_dir) if cache_dir else None)
    if tokenizer is None:
        raise SystemExit(f"model {name!r} has no tokenizer: give --tokenizer DIR (a directory with tokenizer.json)")
    config = router_config_from_args(args, name, max_len, os.environ.get("PDSERVE_SECRET") or None)
    logging.getLogger("pdserve.router").info("router for %s on http://%s:%d", name, args.host, args.port)
    uvicorn.run(create_app(config, tokenizer), host=args.host, port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=3)
    return 0
