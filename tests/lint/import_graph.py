"""pdserve's import graph, read from the source with `ast` (nothing is imported): which first-party modules a
module imports, and everything it reaches through them.

Module names are the installed ones (`pdserve.router.app`); pyproject.toml's `package-dir` maps each to its
file (`router/app.py`). Every import counts, wherever it stands: at the top, inside a function (a lazy
import is still an import of that process) or under `if TYPE_CHECKING:`. Importing `a.b.c` runs `a/__init__`
and `a/b/__init__` first, so a module reaches its parent packages too.
"""

from __future__ import annotations

import ast
import tomllib
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT_PACKAGE = "pdserve"


@dataclass(frozen=True)
class Reached:
    """What a set of modules reaches: first-party modules (each with the module that imported it first, for
    the chain in an error message) and the top-level names of the third-party ones."""

    first_party: dict[str, str | None]  # module -> the module that imported it (None: a start)
    third_party: dict[str, str]  # top-level name ("torch") -> the first-party module that imported it

    def chain(self, module: str) -> list[str]:
        """start → … → `module`, the first path found."""
        path = [module]
        while (parent := self.first_party[path[-1]]) is not None:
            path.append(parent)
        return path[::-1]


@cache
def package_dirs() -> dict[str, Path]:
    """`pdserve.router` -> REPO/router, …, from pyproject.toml."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setup["package-dir"].items()}


def module_file(module: str) -> Path | None:
    """The file that defines `module`, or None where it is not first-party (or no such module exists)."""
    dirs = package_dirs()
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        base = dirs.get(".".join(parts[:cut]))
        if base is None:
            continue
        path = base.joinpath(*parts[cut:])
        for candidate in (path / "__init__.py", path.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None
    return None


def modules_in(package: str) -> list[str]:
    """Every module of a first-party package (its `__init__` and each .py below it)."""
    folder = package_dirs()[package]
    names = []
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder).with_suffix("").parts
        names.append(".".join([package, *(relative[:-1] if relative[-1] == "__init__" else relative)]))
    return names


@cache
def imports_of(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(first-party modules, third-party top-level names) that `module`'s own source imports."""
    path = module_file(module)
    assert path is not None, f"{module} is not a first-party module"
    is_package = path.name == "__init__.py"
    first: set[str] = set()
    third: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.module, node.level)
            # `from pkg import name`: name may be a submodule (imported then) or an attribute of pkg
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names
                               if module_file(f"{base}.{alias.name}") is not None)]
        for target in targets:
            if target.split(".")[0] == ROOT_PACKAGE:
                first.update(_with_parents(target))
            elif target != "__future__":
                third.add(target.split(".")[0])
    first.discard(module)
    return frozenset(first), frozenset(third)


def reached_from(starts: list[str]) -> Reached:
    """Breadth first over first-party imports from `starts` (third-party modules are not followed)."""
    first_party: dict[str, str | None] = {}
    third_party: dict[str, str] = {}
    queue: deque[str] = deque()
    for start in starts:
        for module in _with_parents(start):
            if module not in first_party:
                first_party[module] = None
                queue.append(module)
    while queue:
        module = queue.popleft()
        assert module_file(module) is not None, f"{first_party[module]} imports {module}, which does not exist"
        first, third = imports_of(module)
        for name in sorted(third):
            third_party.setdefault(name, module)
        for target in sorted(first):
            if target not in first_party:
                first_party[target] = module
                queue.append(target)
    return Reached(first_party, third_party)


def _absolute(module: str, is_package: bool, name: str | None, level: int) -> str:
    if level == 0:
        assert name is not None
        return name
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:cut]) for cut in range(1, len(parts) + 1)]
