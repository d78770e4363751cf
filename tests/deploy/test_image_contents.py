"""The image holds only what the code imports: every runtime dependency in pyproject.toml (the gpu extra too,
which the GPU image installs) is imported by the packaged code, or is a plug-in its imports load by name."""

from __future__ import annotations

import ast
import re
import tomllib

from tests.deploy.topology import REPO

# distributions no `import` names, loaded by the ones that are imported: uvicorn's event loop and HTTP parser,
# redis-py's C parser
PLUGINS = {"uvloop": "uvicorn", "httptools": "uvicorn", "hiredis": "redis"}
IMPORT_NAMES = {"prometheus-client": "prometheus_client", "pyyaml": "yaml", "huggingface_hub": "huggingface_hub"}


def _imports() -> set[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    found: set[str] = set()
    for folder in {p.split("/")[0] for p in pyproject["tool"]["setuptools"]["package-dir"].values()}:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module.split(".")[0])
    return found


def test_every_dependency_is_imported() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = pyproject["dependencies"] + pyproject["optional-dependencies"]["gpu"]
    imported = _imports()
    unused = []
    for requirement in requirements:
        name = re.split(r"[<>=;\[ ]", requirement, maxsplit=1)[0].strip()
        module = IMPORT_NAMES.get(name, name.replace("-", "_"))
        if module not in imported and PLUGINS.get(name) not in imported:
            unused.append(name)
    assert not unused, f"dependencies no packaged code imports (drop them from the image): {unused}"
    assert "cupy" not in " ".join(requirements)
