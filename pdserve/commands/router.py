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
from typing import TYPE_CHECKING

from pdserve.env_flags import apply_env_defaults
from pdserve.gc_tuning import collector_off_while_starting

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.engine.weights.hub import HubOptions


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pdserve.router_flags import add_router_arguments
    from pdserve.worker.flags import add_log_arguments, add_model_source_arguments

    parser = subparsers.add_parser("router", help="start the router (OpenAI API)", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the API")
    add_log_arguments(parser)
    add_model_source_arguments(parser)
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block (the router and every worker must agree)")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="a static prefill worker (repeatable; default: none, workers register)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a static decode worker (repeatable; default: none, workers register)")
    add_router_arguments(parser)
    apply_env_defaults(parser, os.environ)
    parser.set_defaults(func=run)


def model_facts(model: str, load_format: str, preset: str | None, tokenizer_dir: str | None,
                cache_dir: Path | None, hub: HubOptions | None = None) -> tuple[str, Tokenizer | None, int]:
    """(model name, tokenizer, max_model_len) without loading any weight."""
    from pdserve.engine.presets import get_preset
    from pdserve.engine.weights import ModelSpec, resolve_model
    from pdserve.engine.weights.fetch import default_cache_dir
    from pdserve.engine.weights.hf_config import hf_config
    from pdserve.engine.weights.hub import HubOptions
    from pdserve.engine.weights.locate import load_tokenizer, model_dir
    from pdserve.engine.weights.registry import ModelKind

    hub = hub or HubOptions()
    name_or_preset = (preset or model) if load_format == "dummy" else model
    resolved = resolve_model(name_or_preset, load_format)
    tokenizer = load_tokenizer(ModelSpec(name_or_preset, load_format, tokenizer=tokenizer_dir, hub=hub), cache_dir)
    if resolved.kind is ModelKind.DUMMY:
        return resolved.name, tokenizer, get_preset(resolved.preset or "").max_model_len
    path = model_dir(resolved, cache_dir or default_cache_dir(), hub=hub)
    return resolved.name, tokenizer, hf_config(path, resolved.name).max_model_len


def run(args: argparse.Namespace) -> int:
    collector_off_while_starting()  # on again once serving (pdserve/gc_tuning.py)
    import logging

    from pdserve.engine.weights.hub import HubOptions, ModelNotFoundError
    from pdserve.router.app import create_app
    from pdserve.router.cors import install_cors
    from pdserve.router_flags import cors_from_args, read_chat_template, router_config
    from pdserve.router_server import ListenSettings, serve_router

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call to a worker otherwise
    try:
        listen = ListenSettings(args.host, args.port, args.ssl_keyfile, args.ssl_certfile, args.internal_port,
                                args.log_level, args.fd, args.internal_fd)
        cors = cors_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    cache_dir = os.environ.get("PDSERVE_CACHE_DIR")
    hub = HubOptions(revision=args.revision, cache_dir=args.download_dir)
    try:
        name, tokenizer, max_len = model_facts(args.model, args.load_format, args.model_preset, args.tokenizer,
                                               Path(cache_dir) if cache_dir else None, hub)
    except (ModelNotFoundError, FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"pdserve router: model {args.model!r}: {exc}") from None
    if tokenizer is None:
        raise SystemExit(f"model {name!r} has no tokenizer: give --tokenizer DIR (a directory with tokenizer.json)")
    template = read_chat_template(args.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    names = tuple(args.served_model_name or (name,))
    try:
        config = router_config(args, names[0], names[1:], min(max_len, args.max_model_len or max_len),
                               os.environ.get("PDSERVE_SECRET") or None)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    app = create_app(config, tokenizer)
    install_cors(app, cors)
    logging.getLogger("pdserve.router").info("router for %s on %s", ", ".join(names), listen.url)
    from pdserve.gc_tuning import quiet_garbage_collector

    quiet_garbage_collector()
    serve_router(app, listen)
    return 0
