"""mypy over all of pdserve, as pyproject.toml's [tool.mypy] says: --strict on every package but kernels/,
which has the default checks (its override there says why, and how many errors --strict finds) (issue 21).

mypy cannot follow setuptools' editable finder (the import hook that maps `pdserve.router` to router/), so
the check runs over a tree of links that mirrors the installed layout, rebuilt on each run under
.mypy_cache/ (git-ignored). mypy's own cache sits beside it: cold (no .mypy_cache) the test takes ~20 s on 2
cores, warm ~2 s. By hand: `.venv/bin/python -m pytest -q tests/lint/test_types.py`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.lint.import_graph import REPO, package_dirs

CACHE = REPO / ".mypy_cache"


def link_tree() -> Path:
    """CACHE/tree/pdserve/: pdserve/'s own entries, and one link per mapped folder (router -> REPO/router …)."""
    root = CACHE / "tree"
    shutil.rmtree(root, ignore_errors=True)
    package = root / "pdserve"
    package.mkdir(parents=True)
    for entry in (REPO / "pdserve").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in package_dirs().items():
        if name != "pdserve":
            (package / name.removeprefix("pdserve.")).symlink_to(folder)
    return root


def _as_repo_paths(output: str) -> str:
    """pdserve/router/app.py -> router/app.py, as the files sit in the checkout."""
    for name, folder in sorted(package_dirs().items(), key=lambda item: -len(item[0])):
        output = output.replace(name.replace(".", "/") + "/", f"{folder.relative_to(REPO)}/")
    return output


def test_mypy_passes() -> None:
    tree = link_tree()
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
               "--cache-dir", str(CACHE / "mypy"), "-p", "pdserve"]
    out = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, _as_repo_paths(out.stdout + out.stderr)
