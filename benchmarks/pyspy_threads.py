"""Where each thread of each process spent its samples, from `py-spy record --format raw` files (with
`--subprocesses --threads`, and `--idle` for what threads wait on): per process and thread, the samples and the
frames they ended in (the innermost Python frame: a C call such as zlib.crc32 or a socket receive counts in the
frame that made it), and for each name given with --frames the samples whose stack holds it anywhere.

    python benchmarks/pyspy_threads.py PROFILE.txt [...] [--top 8] [--frames wait_and_sum read_payload]
        [--rate 250] [--out benchmarks/results/NAME.json]

Processes are named by pid and the words of their command line after the script (`_prefill` for P in
benchmarks/transfer_backends.py); thread names lose their numeric suffix only where py-spy gives none.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_FILE = re.compile(r" \((?:[^()]*/)?([^/()]*)\)$")


def frame_name(frame: str) -> str:
    """'fn (path/to/file.py:12)' -> 'fn (file.py:12)'."""
    return _FILE.sub(r" (\1)", frame)


def process_name(frame: str) -> str:
    pid, _, command = frame.partition(":")
    words = command.strip('"').split()
    script = next((i for i, w in enumerate(words) if w.endswith(".py")), -1)
    return " ".join([pid.removeprefix("process ")] + [w for w in words[script + 1:script + 2] if len(w) < 40])


def read(path: Path) -> list[tuple[str, str, list[str], int]]:
    """(process, thread, frames outermost first, samples) per stack line."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
        if at is None or not count.isdigit():
            continue
        process = process_name([f for f in frames[:at] if f.startswith("process ")][-1])
        thread = re.sub(r"^thread \((\d+)\): ?", "", frames[at]) or frames[at]
        stacks.append((process, thread, [frame_name(f) for f in frames[at + 1:]], int(count)))
    return stacks


def summarize(path: Path, top: int, names: list[str], rate: float) -> dict[str, object]:
    totals: Counter[tuple[str, str]] = Counter()
    leaves: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    holding: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for process, thread, frames, count in read(path):
        key = (process, thread)
        totals[key] += count
        leaves[key][frames[-1] if frames else "(no Python frame)"] += count
        for name in names:
            if any(f.split(" (")[0].endswith(name) for f in frames):
                holding[key][name] += count
    threads = []
    for (process, thread), samples in totals.most_common():
        threads.append({"process": process, "thread": thread, "samples": samples, "seconds": samples / rate,
                        "innermost": dict(leaves[(process, thread)].most_common(top)),
                        "holding": dict(holding[(process, thread)])})
    return {"file": path.name, "rate_hz": rate, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--frames", nargs="*", default=[], help="function names to count stacks holding")
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's -r (samples a second)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = [summarize(p, args.top, args.frames, args.rate) for p in args.profiles]
    for entry in report:
        print(f"== {entry['file']}")
        for t in entry["threads"]:
            held = ", ".join(f"{k} {v}" for k, v in t["holding"].items())
            print(f"  [{t['process']}] {t['thread']}: {t['samples']} samples ({t['seconds']:.2f} s){'; ' + held if held else ''}")
            for frame, n in list(t["innermost"].items())[:args.top]:
                print(f"      {n:6d}  {frame}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
