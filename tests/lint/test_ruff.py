"""`ruff check .` is clean (pyproject.toml's [tool.ruff]; the version is pinned in the dev extra, since ruff's
default rules change between releases)."""

from __future__ import annotations

import subprocess
import sys

from tests.lint.import_graph import REPO


def test_ruff_check_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
