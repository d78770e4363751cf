"""A link tree of another checkout's product, importable with PYTHONPATH=DEST (no build, no install): DEST/pdserve
is a folder whose entries link to TREE/pdserve's, plus one link per pyproject package-dir mapping
(pdserve.engine -> TREE/engine, ...), i.e. the installed layout. For before/after runs against an older commit
(`git archive COMMIT | tar -x -C .old`); benchmarks/serving_gpu.py --product DEST runs the deployments on it.

    python benchmarks/tree_link.py TREE DEST        # prints where pdserve.engine and pdserve.kernels resolve
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from pathlib import Path


def link_tree(tree: Path, dest: Path) -> Path:
    tree = tree.resolve()
    mapping = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = dest / "pdserve"
    package.mkdir(parents=True, exist_ok=False)
    for entry in (tree / mapping.get("pdserve", "pdserve")).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in sorted(mapping.items()):
        if name == "pdserve":
            continue
        parts = name.split(".")[1:]
        target = package.joinpath(*parts)
        if target.is_symlink():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(tree / folder)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("dest", type=Path)
    args = parser.parse_args()
    dest = link_tree(args.tree, args.dest)
    check = ("import pdserve.engine.model as m, pdserve.kernels.prefill_attention_triton as k, pdserve.cli as c; "
             "print(c.__file__); print(m.__file__); print(k.__file__)")
    return subprocess.run([sys.executable, "-P", "-c", check], env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(dest), os.environ.get("PYTHONPATH")]))}, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
