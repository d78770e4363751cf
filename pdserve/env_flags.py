"""Command-line defaults from `PDSERVE_*` environment variables, so a container (compose.yaml) configures every
process through its environment.

`apply_env_defaults(parser, environ)`: for every option `--some-flag` of the parser (dest `some_flag`) the
variable `PDSERVE_SOME_FLAG`, when set and not empty, becomes the default; a flag given on the command line
still wins. Values go through the flag's own type and choices; a repeatable flag takes a comma-separated list;
an on/off flag takes 1/0, true/false, yes/no, on/off. The help of each flag names its variable.

Only command modules call this, with `os.environ` (library code never reads the environment).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

PREFIX = "PDSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(dest: str) -> str:
    return PREFIX + dest.upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    """Set defaults from the environment; returns {dest: value} of those taken (tests, logs)."""
    taken: dict[str, Any] = {}
    for action in parser._actions:  # argparse has no public way to list a parser's options
        if not action.option_strings or action.dest in (argparse.SUPPRESS, "help"):
            continue
        var = env_name(action.dest)
        if action.help is not None and action.help != argparse.SUPPRESS:
            action.help = f"{action.help} [env {var}]"
        elif action.help is None:
            action.help = f"[env {var}]"
        raw = environ.get(var, "").strip()
        if not raw:
            continue
        try:
            value = _convert(action, raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            raise SystemExit(f"pdserve: {var}={raw!r} is not a valid {action.option_strings[-1]}: {exc}") from exc
        action.default = value
        parser.set_defaults(**{action.dest: value})
        taken[action.dest] = value
    return taken


def _convert(action: argparse.Action, raw: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        return _boolean(raw)
    if isinstance(action, argparse._AppendAction):
        return [_one(action, part.strip()) for part in raw.split(",") if part.strip()]
    return _one(action, raw)


def _one(action: argparse.Action, raw: str) -> Any:
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"choose one of {list(action.choices)}")
    return value


def _boolean(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
