"""How the suite splits over pytest-xdist's workers (`-n 2 --dist loadgroup`, pyproject's addopts).

Each test module is one unit of work: its module-scoped fixtures are built once, on one worker. A module any of
whose tests uses a package-scoped fixture (a folder's shared deployment: tests/e2e, tests/reliability,
tests/deploy) joins that package's unit, so the deployment starts once and its folder's own ordering hooks
(e2e's shutdown test last, reliability's security module last) still hold: a unit's tests run in collection
order on one worker. Modules using the session's transformers load (~25 s: `hf_model`, `hf_tokenizer`) share one
unit too. Everything else is spread over the workers as they free up.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

# session fixtures too costly to build on both workers
COSTLY_SESSION_FIXTURES = {"hf_model": "transformers", "hf_tokenizer": "transformers"}


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


def assign_units(items: list[pytest.Item]) -> None:
    """Mark every item with the xdist_group of its unit (module, package or transformers)."""
    modules: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        modules[item.nodeid.split("::", 1)[0]].append(item)
    for module, members in modules.items():
        shared = next((unit for unit in map(_shared_unit, members) if unit is not None), None)
        for item in members:
            item.add_marker(pytest.mark.xdist_group(shared or module))
