"""`pdserve docs configuration | performance`: the generated parts of the documentation.

    pdserve docs configuration > docs/configuration.md      every command's flags (pdserve/config_doc.py)
    pdserve docs performance --write README.md               the measured-numbers table (bench/perf_doc.py)
    pdserve docs performance --write docs/benchmarks.md

Each flag's default would follow a PDSERVE_<FLAG> variable set in this shell (pdserve/env_flags.py), so the
parser documented here is built with every PDSERVE_* variable hidden: the document shows the code's defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve import commands


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("docs", help="print the generated parts of the documentation")
    parts = parser.add_subparsers(dest="part", required=True, metavar="PART")
    config = parts.add_parser("configuration", help="docs/configuration.md: every command's flags and variables")
    config.set_defaults(func=run_configuration)
    perf = parts.add_parser("performance", help="the table of measured numbers from benchmarks/results/*.json")
    perf.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"),
                      help="where the benchmark JSON files are")
    perf.add_argument("--write", type=Path, default=None, metavar="FILE.md",
                      help="replace the table between the markers in FILE.md instead of printing it")
    perf.set_defaults(func=run_performance)


@contextmanager
def hidden_pdserve_env() -> Iterator[None]:
    """PDSERVE_* variables out of os.environ for the block, put back afterwards."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("PDSERVE_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def configuration_markdown() -> str:
    from pdserve.cli import build_parser
    from pdserve.config_doc import render

    with hidden_pdserve_env():
        parser = build_parser()
    return render(parser, Path(commands.__file__).parent)


def run_configuration(args: argparse.Namespace) -> int:
    sys.stdout.write(configuration_markdown())
    return 0


def run_performance(args: argparse.Namespace) -> int:
    from pdserve.bench.perf_doc import collect, render_table, replace_region

    sources = collect(args.results_dir)
    if args.write is None:
        sys.stdout.write(render_table(sources, "benchmarks/results/") + "\n")
        return 0
    prefix = os.path.relpath(args.results_dir, args.write.parent).replace(os.sep, "/") + "/"
    try:
        text = replace_region(args.write.read_text(), render_table(sources, prefix))
    except ValueError as exc:
        print(f"pdserve docs performance: {args.write}: {exc}", file=sys.stderr)
        return 2
    args.write.write_text(text)
    print(f"{args.write}: {sum(len(s.rows) for s in sources)} rows from {len(sources)} result files")
    return 0
