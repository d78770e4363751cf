"""The host's staging of a decode step's inputs (engine/decode_staging.py HostStaging.fill), block tables
converted incrementally against converted whole every step (as before 2026-12-06), in one run; with --against
REV also the HostStaging of that git revision (its engine/decode_staging.py, loaded beside this one), interleaved.

    python benchmarks/decode_staging_cpu.py --out benchmarks/results/decode_staging_cpu.json [--against 4f8d99b]

Per batch and context: the rows' block tables are lists that grow by a block every 16 tokens (the scheduler's
request.block_ids); each timed step advances every row by one token, so one row in 16 gains a block, as in a
decode loop. "whole" stages tuples of the same tables (a table that is not a list is converted whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import types
from pathlib import Path

import torch

from pdserve.engine.attention_metadata import DecodeInput
from pdserve.engine.decode_staging import HostStaging

BLOCK = 16
CASES = ((64, 4096), (64, 512), (256, 4096), (256, 8192))


def staging_of(rev: str) -> type:
    """HostStaging as engine/decode_staging.py defines it at git revision `rev`, or in the file `rev` (a copy
    taken with `git show REV:engine/decode_staging.py`, for a host whose checkout has no git history)."""
    root = Path(__file__).resolve().parents[1]
    if Path(rev).is_file():
        source = Path(rev).read_text()
    else:
        source = subprocess.run(["git", "show", f"{rev}:engine/decode_staging.py"], cwd=root, check=True,
                                capture_output=True, text=True).stdout
    module = types.ModuleType(f"decode_staging_{Path(rev).stem}")
    exec(compile(source, f"{rev}:engine/decode_staging.py", "exec"), module.__dict__)  # noqa: S102 -- our own file
    return module.HostStaging


def step_us(batch: int, context: int, whole: bool, steps: int = 200, staging_cls: type = HostStaging) -> float:
    per_seq = -(-(context + BLOCK + steps) // BLOCK) + 1  # room for every step's growth
    staging = staging_cls(batch, per_seq, BLOCK, torch.device("cpu"))
    tables = [list(range(i * per_seq, i * per_seq + -(-(context + i % BLOCK + 1) // BLOCK))) for i in range(batch)]
    positions = [context + i % BLOCK for i in range(batch)]
    times = []
    for _ in range(steps):
        rows = [DecodeInput(1, p, tuple(t) if whole else t) for p, t in zip(positions, tables, strict=True)]
        start = time.perf_counter()
        staging.fill(rows, batch)
        times.append((time.perf_counter() - start) * 1e6)
        for i, table in enumerate(tables):  # the next step: one token more, a block more every 16
            positions[i] += 1
            if positions[i] >= len(table) * BLOCK:
                table.append(table[-1] + 1)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_staging_cpu.json"))
    parser.add_argument("--against", help="a git revision, or a file holding its engine/decode_staging.py, whose "
                                          "HostStaging is timed beside (incremental)")
    args = parser.parse_args()
    other = staging_of(args.against) if args.against else None
    rows = {}
    for batch, context in CASES:  # three runs of each, interleaved: the median of their medians
        runs = [(step_us(batch, context, False), step_us(batch, context, True),
                 step_us(batch, context, False, staging_cls=other) if other else float("nan")) for _ in range(3)]
        incremental, whole, against = (statistics.median(r[j] for r in runs) for j in (0, 1, 2))
        row = rows[f"b{batch}_ctx{context}"] = {"incremental_us": incremental, "whole_us": whole,
                                                "speedup": whole / incremental}
        line = f"b{batch:4d} ctx {context:5d}: incremental {incremental:8.1f} us, whole {whole:8.1f} us " \
               f"({whole / incremental:.1f}x)"
        if other:
            row.update(against_us=against, against_speedup=against / incremental)
            line += f", {args.against}'s {against:8.1f} us ({against / incremental:.2f}x)"
        print(line, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
              "command": "python benchmarks/decode_staging_cpu.py" + (f" --against {args.against}" if other else ""),
              "host": f"{os.cpu_count()} cores", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
