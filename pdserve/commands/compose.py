"""`pdserve compose --prefill-gpus 0,1 --decode-gpus 2,3`: write a Compose file with one service per worker,
each on its GPU (pdserve/compose_file.py), from compose.yaml; then `docker compose -f FILE up -d`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("compose", help="write a Compose file placing each worker on its GPU",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-gpus", required=True, metavar="IDS",
                        help="GPU ids of the prefill workers, one worker each (a GPU listed twice holds two)")
    parser.add_argument("--decode-gpus", required=True, metavar="IDS", help="GPU ids of the decode workers")
    parser.add_argument("--template", type=Path, default=Path("compose.yaml"),
                        help="pdserve's compose.yaml, whose services the workers copy")
    parser.add_argument("--output", type=Path, default=Path("compose.gpus.yaml"),
                        help="the file written ('-': stdout)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.compose_file import GpuPlacement, gpu_compose, load_template, parse_gpus, render

    try:
        placement = GpuPlacement(parse_gpus(args.prefill_gpus), parse_gpus(args.decode_gpus))
        template = load_template(args.template)
    except (OSError, TypeError, ValueError) as exc:
        print(f"pdserve compose: {exc}", file=sys.stderr)
        return 2
    command = "pdserve compose " + " ".join(shlex.quote(w) for w in
                                            ("--prefill-gpus", args.prefill_gpus, "--decode-gpus", args.decode_gpus))
    out_dir = Path.cwd() if str(args.output) == "-" else args.output.resolve().parent
    context = os.path.relpath(args.template.resolve().parent, out_dir)
    text = render(gpu_compose(template, placement, context), command)
    if str(args.output) == "-":
        sys.stdout.write(text)
        return 0
    args.output.write_text(text)
    workers = ", ".join(f"{role}-{i} on GPU {gpu}" for role, i, gpu in placement.workers())
    print(f"{args.output}: {workers}; start it with: docker compose -f {args.output} up -d")
    return 0
