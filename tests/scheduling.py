"""How the suite splits over pytest-xdist's workers (`-n 2 --dist loadgroup`, pyproject's addopts).

Each test module is one unit of work: its module-scoped fixtures are built once, on one worker. A module any of
whose tests uses a package-scoped fixture (a folder's shared deployment: tests/e2e, tests/reliability,
tests/deploy) joins that package's unit, so the deployment starts once and its folder's own ordering hooks
(e2e's shutdown test last, reliability's security module last) still hold: a unit's tests run in collection
order on one worker. Modules using the session's transformers load (~25 s: `hf_model`, `hf_tokenizer`) share one
unit too. Everything else is spread over the workers as they free up.

Units are handed out in collection order (`--no-loadscope-reorder`), and `assign_units` puts the longest first
(longest-processing-time first: a long unit handed out last leaves the other worker idle at the end). Measured in
one two-worker run (2026-12-04): tests/e2e's shared unit 367 s and tests/reliability 336 s, then the other units
that start deployments (tests/e2e's own modules, tests/deploy, tests/docs, 15-90 s each), everything else < 45 s.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

# session fixtures too costly to build on both workers
COSTLY_SESSION_FIXTURES = {"hf_model": "transformers", "hf_tokenizer": "transformers"}
# handed out first, in this order: the two longest units, then the folders whose tests start deployments
FIRST = ("tests/e2e", "tests/reliability")
DEPLOYING_FOLDERS = ("tests/e2e/", "tests/deploy/", "tests/docs/", "transformers")


def _shared_unit(item: pytest.Item) -> str | None:
    """The unit that a fixture `item` uses ties it to, if any."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name, defs in info.name2fixturedefs.items():
        if name in COSTLY_SESSION_FIXTURES:
            return COSTLY_SESSION_FIXTURES[name]
        for fixturedef in defs:
            if fixturedef.scope == "package":
                return fixturedef.baseid or "package"
    return None


def _rank(unit: str) -> int:
    if unit in FIRST:
        return FIRST.index(unit)
    return len(FIRST) + (0 if unit.startswith(DEPLOYING_FOLDERS) else 1)


def assign_units(items: list[pytest.Item]) -> dict[int, str]:
    """Mark every item with the xdist_group of its unit (module, package or transformers); {id(item): unit}."""
    modules: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        modules[item.nodeid.split("::", 1)[0]].append(item)
    unit_of: dict[int, str] = {}
    for module, members in modules.items():
        shared = next((unit for unit in map(_shared_unit, members) if unit is not None), None)
        for item in members:
            item.add_marker(pytest.mark.xdist_group(shared or module))
            unit_of[id(item)] = shared or module
    return unit_of


def order_units(items: list[pytest.Item], unit_of: dict[int, str]) -> None:
    """Items by their unit's rank; stable, so the folders' own orderings (applied before) hold within a unit."""
    items.sort(key=lambda item: _rank(unit_of.get(id(item), "")))
