"""docs/configuration.md is what `pdserve docs configuration` generates from the code today: every command,
every flag, every PDSERVE_* variable. A new or changed flag fails here until the document is regenerated."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.commands.docs import configuration_markdown, hidden_pdserve_env
from pdserve.config_doc import UNDOCUMENTED, env_reads, iter_commands, split_env
from tests.docs.markdown_blocks import REPO

DOC = REPO / "docs" / "configuration.md"
REGENERATE = "regenerate it: .venv/bin/pdserve docs configuration > docs/configuration.md"


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    with hidden_pdserve_env():
        return build_parser()


def test_document_is_what_the_code_generates() -> None:
    assert DOC.read_text() == configuration_markdown(), f"docs/configuration.md is out of date; {REGENERATE}"


def test_every_command_flag_and_variable_appears(parser: argparse.ArgumentParser) -> None:
    text = DOC.read_text()
    missing = []
    for command, sub in iter_commands(parser):
        if f"## `{command}`" not in text:
            missing.append(command)
        section = text.split(f"## `{command}`", 1)[-1].split("\n## ", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help") and f"`{flag}" not in section:
                    missing.append(f"{command} {flag}")
            env = split_env(action.help or "")[1]
            if env and f"`{env}`" not in section:
                missing.append(f"{command} {env}")
    assert not missing, f"missing from docs/configuration.md: {missing}; {REGENERATE}"


def test_every_variable_read_directly_is_explained() -> None:
    reads = env_reads(REPO / "pdserve" / "commands")
    assert {"PDSERVE_CACHE_DIR", "PDSERVE_SECRET"} <= set(reads)
    assert UNDOCUMENTED not in DOC.read_text(), \
        "a command module reads a variable that pdserve/config_doc.py's ENV_ONLY_HELP does not explain"


def test_env_defaults_do_not_leak_into_the_document(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PORT", "9999")
    monkeypatch.setenv("PDSERVE_MAX_NUM_SEQS", "7")
    assert configuration_markdown() == DOC.read_text()


def test_the_command_prints_the_document() -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "docs", "configuration"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == DOC.read_text()
