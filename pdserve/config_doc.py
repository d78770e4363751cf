"""docs/configuration.md, generated from the code: every subcommand of `pdserve.cli.build_parser()`, every flag
with its default, unit, `PDSERVE_*` variable and help, and the variables the command modules read directly.

    build_parser() ─▶ walk subparsers (nested too: `pdserve model fetch`) ─▶ one table per argument group
    pdserve/commands/*.py ─▶ ast: os.environ.get("NAME") / os.environ["NAME"] ─▶ the env-only variables

The parser must be built with no `PDSERVE_*` variable set (the `docs` command clears them first): each
`apply_env_defaults` call (pdserve/env_flags.py) turns a set variable into the flag's default, and the document
shows the code's defaults. The variable of a flag is read back from the "[env PDSERVE_X]" its help ends with,
so the document names exactly the flags that `apply_env_defaults` covers (router, prefill, decode).

Nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.vllm_flags import render_vllm_table

_ENV_SUFFIX = re.compile(r"\s*\[env (PDSERVE_[A-Z0-9_]+)\]$")
# What the variables read straight from os.environ mean (they have no flag). A variable found in a command
# module but missing here is listed as "(undocumented)", which tests/docs/test_configuration_doc.py refuses.
ENV_ONLY_HELP = {
    "PDSERVE_CACHE_DIR": "model cache: where the default model is fetched and GGUF files are converted "
                         "(default ~/.cache/pdserve; compose mounts the `model-cache` volume at /cache)",
    "PDSERVE_SECRET": "shared secret of the internal API: sent as `X-PDServe-Secret` on every `/internal/*` call "
                      "and HMAC key of the KV transfer handshake; router and workers must agree (empty: none)",
    "PDSERVE_MODEL": "`pdserve model fetch`'s default MODEL (compose's one-shot `model` service fetches what every "
                     "service will serve); for router and workers it is the --model flag's variable",
    "OPENAI_API_KEY": "API key `pdserve bench` sends as `Authorization: Bearer` (a router started with "
                      "--api-key wants it)",
}
UNDOCUMENTED = "(undocumented)"
# argparse's BooleanOptionalAction (Python 3.11) appends this to its help; the table has its own default column
_ARGPARSE_DEFAULT = re.compile(r"\s*\(default: %\(default\)s\)")


@dataclass(frozen=True)
class FlagDoc:
    """One option or positional argument of one command."""

    command: str  # "pdserve router"
    group: str
    flags: str  # "--port" or "--num-blocks N"; a positional: its name
    default: str
    unit: str
    env: str | None
    help: str


# Serving commands first, in the order a deployment starts them; any other command after these, by name.
COMMAND_ORDER = ("serve", "router", "prefill", "decode", "bench", "profile", "plan", "generate", "model", "docs")


def iter_commands(parser: argparse.ArgumentParser, prefix: str = "pdserve") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of every leaf subcommand: COMMAND_ORDER first, then by name."""
    sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not sub:
        yield prefix, parser
        return
    for name in sorted(sub[0].choices, key=_rank):
        yield from iter_commands(sub[0].choices[name], f"{prefix} {name}")


def _rank(name: str) -> tuple[int, str]:
    return (COMMAND_ORDER.index(name) if name in COMMAND_ORDER else len(COMMAND_ORDER), name)


def command_flags(command: str, parser: argparse.ArgumentParser) -> list[FlagDoc]:
    docs: list[FlagDoc] = []
    for group in parser._action_groups:  # argparse's only record of which group an action belongs to
        for action in group._group_actions:
            if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
                continue
            help_text, env = split_env(action.help or "")
            help_text = _ARGPARSE_DEFAULT.sub("", help_text)
            docs.append(FlagDoc(command, _group_title(group), _flag_words(action), _default(action),
                                _unit(action), env, help_text))
    return docs


def split_env(help_text: str) -> tuple[str, str | None]:
    """'port [env PDSERVE_PORT]' -> ('port', 'PDSERVE_PORT')."""
    match = _ENV_SUFFIX.search(help_text)
    if not match:
        return help_text, None
    return help_text[:match.start()], match.group(1)


def env_reads(commands_dir: Path) -> dict[str, list[str]]:
    """{variable: [command modules reading it]} for every os.environ.get("X") / os.environ["X"] there."""
    found: dict[str, list[str]] = {}
    for path in sorted(commands_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = _environ_key(node)
            if name is not None and path.stem not in found.setdefault(name, []):
                found[name].append(path.stem)
    return found


def _environ_key(node: ast.AST) -> str | None:
    target: ast.AST | None = None
    key: ast.AST | None = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        target, key = node.func.value, node.args[0]
    elif isinstance(node, ast.Subscript):
        target, key = node.value, node.slice
    is_environ = isinstance(target, ast.Attribute) and target.attr == "environ"
    if is_environ and isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    return None


def render(parser: argparse.ArgumentParser, commands_dir: Path) -> str:
    """The whole of docs/configuration.md."""
    commands = list(iter_commands(parser))
    lines = _preamble()
    lines += ["Commands: " + ", ".join(f"[`{c}`](#{_slug(c)})" for c, _ in commands) + ". Coming from vLLM: "
              "[the flag table](#coming-from-vllm).", ""]
    lines += _env_only_section(env_reads(commands_dir))
    for command, sub in commands:
        lines += _command_section(command, sub)
    lines += render_vllm_table()
    return "\n".join(lines).rstrip() + "\n"


def _preamble() -> list[str]:
    return [
        "# Configuration reference",
        "",
        "<!-- Generated by `pdserve docs configuration > docs/configuration.md` (pdserve/config_doc.py) from the",
        "     parser itself; do not edit by hand: tests/docs/test_configuration_doc.py fails when it differs. -->",
        "",
        "Every command, every flag, its default and its unit, as `pdserve <command> --help` prints them.",
        "",
        "- **Environment.** For `pdserve router`, `pdserve prefill` and `pdserve decode`, every flag `--some-flag`",
        "  defaults to the variable `PDSERVE_SOME_FLAG` when it is set and not empty (column *env*;",
        "  pdserve/env_flags.py). A flag on the command line wins over the variable. Repeatable flags take a",
        "  comma-separated list (`PDSERVE_PREFILL=http://a:8100,http://b:8100`); on/off flags take 1/0, true/false,",
        "  yes/no, on/off. A value the flag would refuse stops the command with the variable's name.",
        "- **`pdserve serve`** reads no `PDSERVE_<FLAG>` variable itself; it passes its model, KV-cache, batching",
        "  and cache-tier flags on to the router and workers it starts, and its router flags to the router (they",
        "  inherit its environment; `--api-key` and `--admin-token` travel as PDSERVE_API_KEY / PDSERVE_ADMIN_TOKEN).",
        "- **Models**: `MODEL` (positional) or `--model` is an embedded name, a Hugging Face repo id (`org/name`,",
        "  found in the hub cache: `--download-dir`, else HF_HUB_CACHE, else HF_HOME/hub, else",
        "  ~/.cache/huggingface/hub; downloaded there when missing and the hub is reachable; HF_HUB_OFFLINE=1",
        "  forbids downloads), a .gguf file or a Hugging Face directory.",
        "- **Sizes** (`--kv-cache-memory`, `--max-body-size`) take binary units: `512MiB`, `2GiB`, `1048576`.",
        "- **Cache tiers**: the `--host-cache-gb` ... `--cache-timeout` flags can also come from a JSON or TOML",
        "  file of the same setting names (`--cache-policy-file`, cache_store/policy.py); flags win over the file.",
        "  The policy part can be changed at run time: [operations.md](operations.md#cache-policies-live).",
        "",
    ]


def _env_only_section(reads: dict[str, list[str]]) -> list[str]:
    lines = ["## Variables without a flag", "",
             "Read directly by the command modules (found in pdserve/commands/*.py).", "",
             "| variable | read by | what |", "|---|---|---|"]
    for name in sorted(reads):
        users = ", ".join(f"`pdserve {m}`" for m in reads[name])
        lines.append(f"| `{name}` | {users} | {_cell(ENV_ONLY_HELP.get(name, UNDOCUMENTED))} |")
    return lines + [""]


def _command_section(command: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `{command}`", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    flags = command_flags(command, parser)
    if not flags:
        return lines + ["No flags.", ""]
    with_env = any(f.env for f in flags)
    for group in dict.fromkeys(f.group for f in flags):
        rows = [f for f in flags if f.group == group]
        lines += [f"**{group}**", ""] if group else []
        lines += ["| flag | default | unit | env | what |" if with_env else "| flag | default | unit | what |",
                  "|---|---|---|---|---|" if with_env else "|---|---|---|---|"]
        for f in rows:
            env = [f"`{f.env}`" if f.env else ""] if with_env else []
            lines.append("| " + " | ".join([", ".join(f"`{w}`" for w in f.flags.split(", ")), _cell(f.default), f.unit, *env, _cell(f.help)]) + " |")
        lines.append("")
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _group_title(group: argparse._ArgumentGroup) -> str:
    title = group.title or ""
    return "" if title in ("options", "optional arguments", "positional arguments") else title


def _flag_words(action: argparse.Action) -> str:
    if not action.option_strings:
        metavar = action.metavar  # a tuple names each of several values
        return " ".join(metavar) if isinstance(metavar, tuple) else metavar or action.dest
    flag = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flag
    if action.choices is not None:
        return f"{flag} {{{','.join(str(c) for c in action.choices)}}}"
    if action.metavar is None:  # argparse's DEST_NAME adds nothing to the flag's own name
        return flag
    return f"{flag} {action.metavar} ..." if action.nargs in ("+", "*") else f"{flag} {action.metavar}"


def _default(action: argparse.Action) -> str:
    value = action.default
    if getattr(action, "required", False):
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    if not action.option_strings and action.nargs == "?":
        return "optional"
    if value is None and action.dest in _tier_defaults():
        value = _tier_defaults()[action.dest]
    if value is None or value == argparse.SUPPRESS:
        return "—" if action.option_strings else "required"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else "none"
    if action.type is not None and getattr(action.type, "__name__", "") == "parse_size" and isinstance(value, int):
        return _size(value)
    return f"`{value}`"


@functools.cache
def _tier_defaults() -> dict[str, Any]:
    """{dest: default} of the cache-tier flags, whose parser default is None (unset: the file or the dataclass
    decides); the dataclass defaults are what a worker gets with neither."""
    from pdserve.cache_store.policy import _FLAGS, CachePolicy, TierConfig  # _FLAGS: setting -> flag

    defaults = {f.name: f.default for cls in (CachePolicy, TierConfig) for f in dataclasses.fields(cls)}
    return {flag.removeprefix("--").replace("-", "_"): defaults[name] for name, (flag, _, _) in _FLAGS.items()}


def _size(value: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value % scale == 0:
            return f"`{value // scale}{unit}`"
    return f"`{value}`"


def _unit(action: argparse.Action) -> str:
    """The unit, by the naming rules the flags follow (…-ms, …-gbps, …-gb, timeouts and intervals in s)."""
    name = action.dest
    if getattr(action.type, "__name__", "") == "parse_size":
        return "bytes"
    rules = (("_ms", "ms"), ("_gbps", "GB/s"), ("_gb", "GiB"), ("_fraction", "0–1"), ("_ratio", "0–1"),
             ("_utilization", "0–1"))
    for suffix, unit in rules:
        if name.endswith(suffix):
            return unit
    if any(word in name for word in ("timeout", "interval", "window", "ttl")):
        return "s"
    if name.endswith("request_rate") or name == "sweep_rate":
        return "req/s"
    if name.endswith(("_len", "_lens", "_tokens", "_context")):
        return "tokens"
    return ""


def _cell(text: str) -> str:
    """Markdown-table safe: one line, no bare pipes."""
    return " ".join(text.split()).replace("|", "\\|")
