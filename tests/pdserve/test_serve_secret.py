"""`pdserve serve` gives its children the internal API's shared secret by environment: a fresh random one
unless PDSERVE_SECRET is set, and the router's API key when --api-key is given (never on a command line)."""

from __future__ import annotations

import re

from pdserve.cli import build_parser
from pdserve.commands.serve import child_environment
from pdserve.launch_plan import plan_children
from pdserve.settings import LaunchSettings


def test_a_fresh_secret_unless_one_is_set() -> None:
    first, second = child_environment({"PATH": "/bin"}, None), child_environment({}, None)
    assert re.fullmatch(r"[0-9a-f]{32}", first["PDSERVE_SECRET"]) and first["PATH"] == "/bin"
    assert first["PDSERVE_SECRET"] != second["PDSERVE_SECRET"] and "PDSERVE_API_KEY" not in first
    kept = child_environment({"PDSERVE_SECRET": "mine", "PDSERVE_API_KEY": "env-key"}, None)
    assert kept["PDSERVE_SECRET"] == "mine" and kept["PDSERVE_API_KEY"] == "env-key"
    assert child_environment({}, "sk-flag")["PDSERVE_API_KEY"] == "sk-flag"


def test_secrets_never_reach_a_command_line() -> None:
    args = build_parser().parse_args(["serve", "--api-key", "sk-flag"])
    assert args.api_key == "sk-flag"
    for child in plan_children(LaunchSettings(), python="py", num_gpus=0):
        assert not any("sk-flag" in word or "SECRET" in word for word in child.argv)
        assert "127.0.0.1" in child.argv  # every process binds loopback unless --host says otherwise
