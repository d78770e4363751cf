"""pyproject.toml lists its packages by hand (setuptools' package-dir maps each top-level folder into the
`pdserve` namespace): a subpackage left out installs fine in editable mode and is missing from a wheel."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_subpackage_is_listed() -> None:
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = set()
    for name, folder in setup["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *relative.parts]))
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but no such package: {sorted(listed - found)}"


def test_the_image_copies_every_package_folder() -> None:
    """The Dockerfile copies the package folders one by one (tests and benchmarks stay out): a folder added to
    package-dir and not copied builds an image whose `pip install` fails on the missing directory."""
    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\S+) /\1$", (REPO / "Dockerfile").read_text(), flags=re.MULTILINE))
    assert folders - copied == set(), f"add to the Dockerfile's src stage: {sorted(folders - copied)}"
