"""`pdserve model fetch | list`: fetch the embedded default model into the cache, list known models."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def cache_dir_from_env() -> Path | None:
    value = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(value) if value else None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="fetch or list models")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser("fetch", help="download, extract and convert the default model (once)")
    fetch.add_argument("--cache-dir", type=Path, default=None,
                       help="model cache (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)")
    fetch.set_defaults(func=run_fetch)
    listing = actions.add_parser("list", help="list embedded models and dummy presets")
    listing.set_defaults(func=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    from pdserve.engine.weights import fetch_default_model

    path = fetch_default_model(args.cache_dir or cache_dir_from_env())
    print(path)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from pdserve.engine.presets import PRESETS
    from pdserve.engine.weights import DEFAULT_MODEL, KNOWN_MODELS

    for name in KNOWN_MODELS:
        print(f"{name}{'  (default)' if name == DEFAULT_MODEL else ''}")
    for name in PRESETS:
        print(f"{name}  (dummy preset: --load-format dummy --model-preset {name})")
    return 0
