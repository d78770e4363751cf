"""Test modules are imported by their basename (pytest's default `prepend` import mode, no packages under
tests/), so two `test_x.py` in two folders cannot both be collected in one session: the second is an
"import file mismatch" error, and the whole suite stops at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1], sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if names[p.name] > 1)
