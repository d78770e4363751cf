"""The `pdserve` command: each subcommand lives in `pdserve/commands/<name>.py` and registers itself there
through `add_parser(subparsers)` (modules named `_*` there are shared by commands, not commands themselves).
Environment variables are read here and in those modules only.

Every parser prints each flag's default in its --help (HelpFormatter), unless the help already says it."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from pdserve import commands


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each flag's help, where the help does not already name its default;
    an on/off flag reads "(default: off)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings or action.required:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every pdserve parser, subcommands' included (argparse makes those of the parent's class)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # shared by commands (pdserve/commands/_worker.py), not one itself
            continue
        module = importlib.import_module(f"pdserve.commands.{info.name}")
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
