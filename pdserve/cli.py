"""The `pdserve` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    parser.add_subparsers(dest="command", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) if hasattr(args, "func") else 0


if __name__ == "__main__":
    sys.exit(main())
