"""The host's staging of a decode step's inputs (engine/decode_staging.py HostStaging.fill), block tables
converted incrementally against converted whole every step (as before 2026-12-06), in one run.

    python benchmarks/decode_staging_cpu.py --out benchmarks/results/decode_staging_cpu.json

Per batch and context: the rows' block tables are lists that grow by a block every 16 tokens (the scheduler's
request.block_ids); each timed step advances every row by one token, so one row in 16 gains a block, as in a
decode loop. "whole" stages tuples of the same tables (a table that is not a list is converted whole).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pdserve.engine.attention_metadata import DecodeInput
from pdserve.engine.decode_staging import HostStaging

BLOCK = 16
CASES = ((64, 4096), (64, 512), (256, 4096), (256, 8192))


def step_us(batch: int, context: int, whole: bool, steps: int = 200) -> float:
    per_seq = -(-(context + BLOCK + steps) // BLOCK) + 1  # room for every step's growth
    staging = HostStaging(batch, per_seq, BLOCK, torch.device("cpu"))
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
    args = parser.parse_args()
    rows = {}
    for batch, context in CASES:  # three runs of each, interleaved: the median of their medians
        runs = [(step_us(batch, context, False), step_us(batch, context, True)) for _ in range(3)]
        incremental, whole = (statistics.median(r[j] for r in runs) for j in (0, 1))
        rows[f"b{batch}_ctx{context}"] = {"incremental_us": incremental, "whole_us": whole,
                                          "speedup": whole / incremental}
        print(f"b{batch:4d} ctx {context:5d}: incremental {incremental:8.1f} us, whole {whole:8.1f} us "
              f"({whole / incremental:.1f}x)", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
              "command": "python benchmarks/decode_staging_cpu.py", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
