"""Every command the docs show runs, so the docs cannot rot.

- Blocks marked runnable (```bash runnable, ```python runnable; tests/docs/markdown_blocks.py) run for real,
  against a live `pdserve serve` on the default model when they address one (tests/docs/conftest.py).
- Every other bash block must at least parse (`bash -n`), and every `pdserve ...` command in it must be
  accepted by the real parser (flags, choices, subcommands); every python block must compile.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.commands.docs import hidden_pdserve_env
from tests.docs.conftest import DocsServer, docs_env
from tests.docs.markdown_blocks import (
    REPO,
    Block,
    all_blocks,
    localize,
    pdserve_command_lines,
    runnable_blocks,
)

BLOCK_TIMEOUT_S = 60.0
RUNNABLE = runnable_blocks()


def _run(block: Block, port: int, cache_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    code = localize(block.code, port)
    if block.lang == "bash":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    elif block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        raise AssertionError(f"{block.name}: runnable blocks are bash or python, not {block.lang!r}")
    return subprocess.run(argv, cwd=REPO, env=docs_env(cache_dir), capture_output=True, text=True, check=False,
                          timeout=BLOCK_TIMEOUT_S)


def test_the_docs_have_runnable_blocks() -> None:
    names = {block.path.name for block in RUNNABLE}
    assert {"README.md", "operations.md", "architecture.md"} <= names, names


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_runnable_block(block: Block, request: pytest.FixtureRequest, docs_server_process: DocsServer,
                        model_cache_dir: Path, tmp_path: Path) -> None:
    port = 0  # a block that addresses no server
    if block.needs_server:
        request.getfixturevalue("docs_server_url")  # waits until the router has a prefill and a decode worker
        port = docs_server_process.port
    result = _run(block, port, model_cache_dir, tmp_path)
    shown = f"{block.name} exited {result.returncode}\n--- stdout\n{result.stdout[-2000:]}\n--- stderr\n" \
            f"{result.stderr[-2000:]}"
    if result.returncode != 0 and block.needs_server:
        shown += f"\n--- server log\n{docs_server_process.log()}"
    assert result.returncode == 0, shown
    if "expect-error" not in block.flags:
        assert '"error"' not in result.stdout, shown


SHELL_BLOCKS = [block for block in all_blocks() if block.lang in ("bash", "sh", "shell")]
PYTHON_BLOCKS = [block for block in all_blocks() if block.lang == "python"]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[block.name for block in SHELL_BLOCKS])
def test_shell_block_parses_and_its_pdserve_commands_exist(block: Block) -> None:
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, f"{block.name}: {syntax.stderr}"
    with hidden_pdserve_env():
        parser = build_parser()
    for words in pdserve_command_lines(block.code):
        if "--help" in words or "-h" in words:
            continue
        try:
            parser.parse_args(words)
        except SystemExit as exc:
            raise AssertionError(f"{block.name}: `pdserve {' '.join(words)}` is refused by the parser") from exc


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block.name for block in PYTHON_BLOCKS])
def test_python_block_compiles(block: Block) -> None:
    compile(block.code, block.name, "exec")
