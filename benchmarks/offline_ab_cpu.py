"""Offline `LLM` throughput of this working tree against another revision, on CPU, alternating in fresh processes.

    .venv/bin/python benchmarks/offline_ab_cpu.py --base REV [--rounds 3] [--out benchmarks/results/offline_ab_cpu.json]

REV is exported with `git archive` into a temporary folder laid out as the installed namespace (pdserve/ with
the component folders linked in), which PYTHONPATH puts ahead of this tree's editable install. Each round runs
the base, then this tree: the 16 prompts of offline_cpu.py at once (batch16) and 4 of them one by one (batch1),
32 greedy tokens each (ignore_eos), one torch thread. On a shared machine wall time swings with the neighbours'
load, so the process CPU time is reported too (tokens per CPU second): the fairer comparison. The greedy tokens
of the two revisions are compared as well.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = ("engine", "kernels", "cache_store", "router", "prefill_node", "decode_node", "kv_transfer", "protocol")
CHILD = """
import json, sys, time
import torch
sys.path.insert(0, {bench!r})
from offline_cpu import PROMPTS
from pdserve.engine.sampling import SamplingParams
from pdserve.llm import LLM
torch.set_num_threads(1)
llm = LLM(num_blocks=1024, max_num_seqs=32, progress=False)
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0))
out = {{}}
for name, prompts in (("batch16", PROMPTS), ("batch1", PROMPTS[:4])):
    llm.pool.evict_all_cached()
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params) if name == "batch16" else [llm.generate([p], params)[0] for p in prompts]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = sum(len(o.token_ids) for o in outs)
    out[name] = {{"tok_per_s": n / wall, "tok_per_cpu_s": n / cpu, "tokens": [o.token_ids for o in outs]}}
print(json.dumps(out))
"""


def export(rev: str, into: Path) -> Path:
    """REV's files, laid out as the installed namespace: into/pkg/pdserve/{cli files, engine/, kernels/, ...}."""
    src, pkg = into / "src", into / "pkg" / "pdserve"
    src.mkdir()
    pkg.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    for entry in (src / "pdserve").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name in COMPONENTS:
        (pkg / name).symlink_to(src / name)
    return into / "pkg"


def run(pythonpath: str | None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = CHILD.format(bench=str(REPO / "benchmarks"))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tempfile.gettempdir(), check=True,
                          capture_output=True, text=True)
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/offline_ab_cpu.json"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"base": [], "tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        base_path = str(export(args.base, Path(tmp)))
        for rnd in range(args.rounds):
            for name, path in (("base", base_path), ("tree", None)):
                runs[name].append(run(path))
                print(f"round {rnd} {name}: " + ", ".join(
                    f"{k} {v['tok_per_s']:.1f} tok/s, {v['tok_per_cpu_s']:.1f} tok/cpu-s" for k, v in runs[name][-1].items()),
                    flush=True)
    same = all(a[k]["tokens"] == b[k]["tokens"] for a in runs["base"] for b in runs["tree"] for k in a)
    summary = {name: {k: {m: statistics.median(r[k][m] for r in rs) for m in ("tok_per_s", "tok_per_cpu_s")}
                      for k in ("batch16", "batch1")} for name, rs in runs.items()}
    for rs in runs.values():
        for r in rs:
            for v in r.values():
                del v["tokens"]
    result = {"base": args.base, "head": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                                                        capture_output=True, text=True).stdout.strip(),
              "load_average_after": os.getloadavg(), "greedy_tokens_equal": same, "median": summary, "runs": runs}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"greedy_tokens_equal": same, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
