"""`pdserve prefill`: start one prefill worker (`--role both` serves prefill and decode over one block pool).

Reads PDSERVE_CACHE_DIR (where models are fetched and converted), PDSERVE_SECRET (shared secret of the
internal API) and every flag's default, PDSERVE_<FLAG> (pdserve/env_flags.py), from the environment; nothing
below this module does. What it shares with the other role's command is in pdserve/commands/_worker.py.
"""

from __future__ import annotations

import argparse
import os

from pdserve.commands._worker import add_worker_parser, run_worker_command


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add_worker_parser(subparsers, "prefill", os.environ, run)


def run(args: argparse.Namespace) -> int:
    return run_worker_command(args, "prefill", cache_dir=os.environ.get("PDSERVE_CACHE_DIR"),
                              secret=os.environ.get("PDSERVE_SECRET") or None)
