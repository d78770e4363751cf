"""CPU-seconds each process of `pdserve serve` spends to "pdserve ready" (launcher, router, prefill, decode),
this checkout against another revision, interleaved, in one run.

    python benchmarks/serve_start_cpu.py --against c21a699 [--no-bytecode] [--starts 15] \
        [--out benchmarks/results/serve_start_cpu.json]

The other revision's files (`git archive REV`) go to a temporary folder, and a link tree lays its package out the
way the installed one is (pyproject's package-dir: pdserve.engine is engine/, ...), first on PYTHONPATH, so its
processes import only its code. Both get their bytecode compiled first, as scripts/setup.sh does for a checkout.
`--no-bytecode` adds HEAD's files the same way with no bytecode and PYTHONDONTWRITEBYTECODE=1: every process
compiles what it imports, as each did before setup.sh compiled (where that variable is set, as on this project's
machines). Each start is the tests' deployment (tests/e2e/deployments.py's worker flags), on this host's cores;
read the medians side by side, not as absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--num-blocks", "512", "--max-num-seqs", "48", "--max-num-batched-tokens", "1024", "--torch-threads", "1"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def link_tree(tree: Path, into: Path) -> Path:
    """`into`/pdserve laid out as the installed package, its folders linked to `tree`'s."""
    package_dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = into / "pdserve"
    root.mkdir(parents=True)
    for entry in (tree / "pdserve").iterdir():
        (root / entry.name).symlink_to(entry)
    for package, folder in package_dirs.items():
        if package != "pdserve":
            (root / package.split(".", 1)[1]).symlink_to(tree / folder)
    return into


def compile_tree(tree: Path) -> None:
    folders = set(tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *sorted(folders)], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)


def mount(rev: str, into: Path, bytecode: bool) -> Path:
    """`rev`'s files under `into`; returns the folder to put first on PYTHONPATH."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True)
    (into / "tree.tar").write_bytes(archive.stdout)
    with tarfile.open(into / "tree.tar") as tar:
        tar.extractall(tree, filter="data")
    if bytecode:
        compile_tree(tree)
    site = link_tree(tree, into / "site")
    where = subprocess.run([sys.executable, "-c", "import pdserve.engine.model as m; print(m.__file__)"], cwd=into,
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site)), f"{rev}'s processes would import {where.stdout.strip()}"
    return site


def start_once(env: dict[str, str], log: Path) -> dict[str, float]:
    from pdserve.launch_plan import free_port

    with log.open("wb") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(free_port()), *FLAGS],
                                    env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    began = time.monotonic()
    try:
        while b"pdserve ready" not in log.read_bytes():
            if launcher.poll() is not None or time.monotonic() - began > 300:
                raise RuntimeError(f"no ready line: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        row = {"wall_s": time.monotonic() - began, "launcher": cpu_seconds(launcher.pid)}
        for pid in children(launcher.pid):
            role = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3].decode()
            row[role] = cpu_seconds(pid)
        return row
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git revision to start beside this checkout")
    parser.add_argument("--no-bytecode", action="store_true", help="also HEAD's files with no bytecode on disk")
    parser.add_argument("--starts", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        variants: dict[str, dict[str, str]] = {}
        compile_tree(REPO)
        if args.against:
            variants[args.against] = {**os.environ, "PYTHONPATH": str(mount(args.against, scratch / "against", True))}
        variants["this checkout"] = dict(os.environ)
        if args.no_bytecode:
            variants["HEAD, no bytecode"] = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                                             "PYTHONPATH": str(mount("HEAD", scratch / "head", False))}
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for i in range(args.starts):
            for v, (name, env) in enumerate(variants.items()):  # interleaved: a busy neighbour slows each alike
                row = start_once(env, scratch / f"start-{v}-{i}.log")
                rows[name].append(row)
                print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    medians = {name: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]} for name, runs in rows.items()}
    for name, values in medians.items():
        print(f"median {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "flags": FLAGS, "cpu_count": os.cpu_count(),
                                        "unit": "CPU-s to ready (utime+stime); wall_s to the ready line",
                                        "medians": medians, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
