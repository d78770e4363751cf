"""The `pdserve` command: each subcommand lives in `pdserve/commands/<name>.py` and registers itself there
through `add_parser(subparsers)`. Environment variables are read here and in those modules only."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from pdserve import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"pdserve.commands.{info.name}")
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
