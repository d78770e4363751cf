"""`pdserve decode`: start one decode worker (`--role both` serves prefill and decode over one block pool).

Reads PDSERVE_CACHE_DIR (where models are fetched and converted), PDSERVE_SECRET (shared secret of the
internal API) and every flag's default, PDSERVE_<FLAG> (pdserve/env_flags.py), from the environment; nothing
below this module does.
"""

from __future__ import annotations

import argparse
import os

from pdserve.env_flags import apply_env_defaults
from pdserve.gc_tuning import collector_off_while_starting
from pdserve.worker.flags import add_worker_arguments, worker_settings_from_args


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("decode", help="start a decode worker",
                                   description="Start a decode worker; with --router it registers there.")
    add_worker_arguments(parser, role="decode")
    apply_env_defaults(parser, os.environ)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    collector_off_while_starting()  # on again once serving (pdserve/gc_tuning.py)
    from pdserve.cache_store.shared_store import StoreError
    from pdserve.engine.weights.hub import ModelNotFoundError
    from pdserve.worker.app import run_worker

    try:
        settings = worker_settings_from_args(
            args, cache_dir=os.environ.get("PDSERVE_CACHE_DIR"), secret=os.environ.get("PDSERVE_SECRET") or None
        )
    except ValueError as exc:
        raise SystemExit(f"pdserve decode: {exc}") from None
    try:
        return run_worker(settings)
    except (ModelNotFoundError, StoreError) as exc:
        raise SystemExit(f"pdserve decode: {exc}") from None
