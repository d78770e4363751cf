"""What `pdserve prefill` and `pdserve decode` share: one parser and one start for a worker of either role
(`--role both` serves prefill and decode over one block pool). Not a command itself: the CLI skips modules
whose name starts with "_". The environment is read by the command modules and passed in.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from pdserve.env_flags import apply_env_defaults
from pdserve.gc_tuning import collector_off_while_starting
from pdserve.worker.flags import add_worker_arguments, worker_settings_from_args


def add_worker_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], role: str,
                      environ: Mapping[str, str], run: Callable[[argparse.Namespace], int]) -> None:
    parser = subparsers.add_parser(role, help=f"start a {role} worker",
                                   description=f"Start a {role} worker; with --router it registers there.")
    add_worker_arguments(parser, role=role)
    apply_env_defaults(parser, environ)
    parser.set_defaults(func=run)


def run_worker_command(args: argparse.Namespace, role: str, cache_dir: str | None, secret: str | None) -> int:
    collector_off_while_starting()  # on again once serving (pdserve/gc_tuning.py)
    from pdserve.cache_store.shared_store import StoreError
    from pdserve.engine.weights import resolve_device, resolve_model
    from pdserve.engine.weights.hub import ModelNotFoundError
    from pdserve.listeners import ListenError
    from pdserve.worker.app import run_worker

    try:
        settings = worker_settings_from_args(args, cache_dir=cache_dir, secret=secret)
    except ValueError as exc:
        raise SystemExit(f"pdserve {role}: {exc}") from None
    model = settings.model
    dummy = model.load_format == "dummy"
    try:  # before anything loads: a mistyped --model ends in one line, as `pdserve router` reports it
        resolve_model((model.model_preset or model.model) if dummy else model.model, model.load_format)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"pdserve {role}: model {model.model!r}: {exc}") from None
    try:
        resolve_device(model.device)
    except ValueError as exc:
        raise SystemExit(f"pdserve {role}: {exc}") from None
    try:
        return run_worker(settings)
    except (ModelNotFoundError, StoreError, ListenError) as exc:
        raise SystemExit(f"pdserve {role}: {exc}") from None
