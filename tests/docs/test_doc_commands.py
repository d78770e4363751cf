"""Every command the docs show runs, so the docs cannot rot.

- Blocks marked runnable (```bash runnable, ```python runnable; tests/docs/markdown_blocks.py) run for real,
  against a live `pdserve serve` on the default model when they address one (tests/docs/conftest.py).
- Blocks marked starts are deployments: each `pdserve` command is started, waited for until ready, stopped.
- Every shell block with a `pdserve` or `docker` command is one of those, or says why the CPU machine cannot
  run it (gpu, docker, hosts, setup).
- Every other bash block must at least parse (`bash -n`), and every `pdserve ...` command in it must be
  accepted by the real parser (flags, choices, subcommands); every python block must compile.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.commands.docs import hidden_pdserve_env
from pdserve.launch_plan import free_port
from tests.docs.conftest import READY_TIMEOUT_S, SERVE_FLAGS, DocsServer, docs_env
from tests.docs.markdown_blocks import (
    REASONS,
    REPO,
    Block,
    all_blocks,
    localize,
    pdserve_command_lines,
    prelude_and_commands,
    runnable_blocks,
)

BLOCK_TIMEOUT_S = 120.0  # `pdserve profile`'s small grid took 25 s on the loaded 2-core machine
RUNNABLE = runnable_blocks()
STARTS = [block for block in all_blocks() if block.starts]


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


def _deployment_argv(words: list[str]) -> list[str]:
    """The command as the test starts it: on a free port, with the test's small KV pool and one torch thread
    per worker unless the block says otherwise (the docs server runs beside it on 2 cores)."""
    extra = [] if "--port" in words else ["--port", str(free_port("127.0.0.1"))]
    if not {"--num-blocks", "--kv-cache-memory"} & set(words):
        extra += SERVE_FLAGS[:2]
    if "--torch-threads" not in words:
        extra += SERVE_FLAGS[2:]
    return [*words, *extra]


@pytest.mark.parametrize("block", STARTS, ids=[block.name for block in STARTS])
def test_deployment_block_starts(block: Block, model_cache_dir: Path, default_model_dir: Path,
                                 tmp_path: Path) -> None:
    prelude, commands = prelude_and_commands(block.code)
    assert commands, f"{block.name}: a starts block needs a pdserve command"
    for i, words in enumerate(commands):
        argv = _deployment_argv(words)
        script = f"{prelude}\nexec {shlex.quote(sys.executable)} -m pdserve.cli {shlex.join(argv)}"
        log_path = tmp_path / f"command{i}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(["bash", "-e", "-c", script], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env=docs_env(model_cache_dir), start_new_session=True)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while "pdserve ready" not in log_path.read_text(errors="replace"):
                shown = f"{block.name}: `pdserve {shlex.join(argv)}`\n{log_path.read_text(errors='replace')[-3000:]}"
                assert process.poll() is None, f"exited with {process.returncode}: {shown}"
                assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S} s: {shown}"
                time.sleep(0.3)
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


_DOCKER = re.compile(r"(^|[\s;&|(])docker(-compose)?\s", re.MULTILINE)


def test_every_command_block_runs_here_or_says_why() -> None:
    silent = []
    for block in all_blocks():
        if block.lang not in ("bash", "sh", "shell"):
            continue
        has_commands = pdserve_command_lines(block.code) or _DOCKER.search(block.code)
        if has_commands and not (block.runnable or block.starts or block.reasons):
            silent.append(block.name)
    assert not silent, (f"shell blocks with pdserve/docker commands that the doc test neither runs nor excuses "
                        f"(mark them runnable, starts, or one of {sorted(REASONS)}): {silent}")


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
