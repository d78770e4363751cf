"""README.md keeps its promises: the two commands come first, word for word; the performance tables of the
README and docs/benchmarks.md are exactly what benchmarks/results/*.json say today; every relative link in
README.md and docs/*.md leads to a file that exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.bench.perf_doc import MARKER_BEGIN, MARKER_END, collect, render_table, replace_region
from tests.docs.markdown_blocks import REPO, doc_files

README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "results"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_two_commands_section_is_first_and_exact() -> None:
    text = README.read_text()
    sections = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert sections[0] == "Two commands", sections
    first = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    # marked `setup`: the doc test does not run them (they change the environment; tests/docs/markdown_blocks.py)
    assert "```bash setup\nbash scripts/setup.sh && .venv/bin/pdserve serve\n```" in first
    assert "```bash setup\nbash scripts/setup.sh && .venv/bin/python -m pytest -q\n```" in first


@pytest.mark.parametrize("doc, prefix", [(README, "benchmarks/results/"),
                                         (REPO / "docs" / "benchmarks.md", "../benchmarks/results/")])
def test_performance_table_is_generated_from_the_results(doc: Path, prefix: str) -> None:
    text = doc.read_text()
    expected = replace_region(text, render_table(collect(RESULTS), prefix))
    assert text == expected, f"{doc.name}'s table differs from benchmarks/results/*.json: run " \
                             f".venv/bin/pdserve docs performance --write {doc.relative_to(REPO)}"
    assert text.count(MARKER_BEGIN) == text.count(MARKER_END) == 1


def test_every_published_number_names_its_source_and_command() -> None:
    sources = collect(RESULTS)
    assert any(s.file == "kernels_h200.json" for s in sources)
    for source in sources:
        assert (RESULTS / source.file).exists() and source.rows and source.command
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", source.date), source.date
        json.loads((RESULTS / source.file).read_text())


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{doc.name} links to missing files: {broken}"


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_anchors_within_the_docs_exist(doc: Path) -> None:
    """Links such as operations.md#security-settings point at a heading that exists (GitHub's slugs)."""
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        file_part, anchor = target.split("#", 1)
        path = (doc.parent / file_part).resolve() if file_part else doc
        if path.suffix == ".md" and path.exists() and anchor not in _slugs(path):
            broken.append(target)
    assert not broken, f"{doc.name} links to missing headings: {broken}"


def _slugs(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
