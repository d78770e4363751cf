"""Fenced code blocks of README.md and docs/*.md, and how the doc tests run them.

A block is *runnable* when its info string carries the word `runnable`:

    ```bash runnable            run with bash -e -o pipefail, from the repository root
    ```python runnable          run with this interpreter, from the repository root
    ```bash runnable expect-error   may print an OpenAI-style error (the docs show one on purpose)
    ```bash starts              each `pdserve` command is a long-running deployment: started, waited for until
                                it is ready, stopped (on a free port, with the test's small KV pool and one
                                torch thread per worker where the block does not say)
    ```bash gpu | docker | hosts | setup | eval    cannot run on the CPU test machine, and says why: it needs a
                                GPU, Docker, several hosts, it changes the environment (scripts/setup.sh), or
                                it needs lm-eval (the `eval` extra, which setup.sh does not install)

Every shell block with a `pdserve` or `docker` command is runnable, starts, or carries such a reason.

Blocks are written for a reader who ran `pdserve serve` on the default address, so before running one the
test points its addresses at the live server (`http://127.0.0.1:8000`, `localhost:8000`) and its
`.venv/bin/...` commands at the interpreter running the tests. Runnable blocks must not write into the
repository (use /tmp for outputs).
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_ADDRESS = "127.0.0.1:8000"
_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_SERVER_HINTS = ("127.0.0.1:8000", "localhost:8000")
REASONS = {"gpu": "needs a GPU", "docker": "needs Docker", "hosts": "needs several hosts",
           "setup": "changes the environment", "eval": "needs lm-eval (pip install -e .[eval]; not in setup.sh)"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    flags: frozenset[str]
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def runnable(self) -> bool:
        return "runnable" in self.flags

    @property
    def starts(self) -> bool:
        return "starts" in self.flags

    @property
    def reasons(self) -> set[str]:
        return set(self.flags) & set(REASONS)

    @property
    def needs_server(self) -> bool:
        return any(hint in self.code for hint in _SERVER_HINTS)


def doc_files() -> list[Path]:
    """README.md and docs/*.md (docs/HELPERS.md, a temporary note for helpers, excepted)."""
    return [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "HELPERS.md")]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(path, line, match.group(1), frozenset(match.group(2).split()), match.group(3)))
    return found


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks(path)]


def runnable_blocks() -> list[Block]:
    """Runnable blocks, those without a server first (they run while the server starts)."""
    found = [block for block in all_blocks() if block.runnable]
    return sorted(found, key=lambda block: block.needs_server)


def localize(code: str, port: int, python: str = sys.executable) -> str:
    """The block as the test runs it: the live server's port, this interpreter."""
    code = code.replace(DEFAULT_ADDRESS, f"127.0.0.1:{port}").replace("localhost:8000", f"127.0.0.1:{port}")
    commands = {"pdserve": f"{shlex.quote(python)} -m pdserve.cli", "python": shlex.quote(python)}
    return re.sub(r"(?<![\w/.])\.venv/bin/(pdserve|python)\b", lambda m: commands[m.group(1)], code)


def pdserve_command_lines(code: str) -> list[list[str]]:
    """The argument lists of every `pdserve ...` / `.venv/bin/pdserve ...` command in a shell block (continued
    lines joined; stops at a pipe, redirection or command separator)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(lexer)
        except ValueError:
            continue
        while words:
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value command
                words = words[1:]
            if not words:
                break
            if words[0] in ("pdserve", ".venv/bin/pdserve"):
                rest = words[1:]
                end = next((i for i, w in enumerate(rest) if set(w) <= set("|&;<>()")), len(rest))
                commands.append(rest[:end])
            end = next((i for i, w in enumerate(words) if w in ("&&", "||", ";", "|")), None)
            if end is None:
                break
            words = words[end + 1:]
    return commands


def prelude_and_commands(code: str) -> tuple[str, list[list[str]]]:
    """A `starts` block: its lines that are no `pdserve` command (exports), and its `pdserve` commands."""
    joined = code.replace("\\\n", " ").splitlines()
    prelude = "\n".join(line for line in joined if line.strip() and not line.lstrip().startswith("pdserve"))
    return prelude, pdserve_command_lines(code)
