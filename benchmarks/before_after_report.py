"""One JSON from two benchmarks/serving_gpu.py runs of the same harness and workload on two trees (issue 23 item 5):
per tree and case TTFT p50 / p99 (and throughput, TPOT), `compiles_after_warmup` (Triton cache entries added
after the deployment was ready), and the prefill worker's py-spy profile (raw format, the first 20 s of the
ShareGPT case): samples in all, in the step thread (stacks through PrefillEngine._run), and those inside
Triton's compiler (frames of triton/compiler, make_ttir/ttgir/llir/ptx/cubin), with the kernels whose launch
compiled most.

    python benchmarks/before_after_report.py --before B.json --after A.json [--before-spy DIR] [--after-spy DIR] \
        [--before-commit C] --out issue23_before_after_h200.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

COMPILER = re.compile(r"triton/compiler|make_ttir|make_ttgir|make_llir|make_ptx|make_cubin")
STEP_THREAD = "PrefillEngine._run"
METRICS = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "output_throughput", "median_tpot_ms",
           "p99_tpot_ms", "duration")


def spy_summary(path: Path) -> dict:
    """Samples of a `py-spy record --format raw` file: all, the step thread's, and those in the compiler."""
    if not path.exists():
        return {"missing": str(path)}
    total = step = compiling = step_compiling = 0
    callers: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        in_step, in_compiler = STEP_THREAD in stack, bool(COMPILER.search(stack))
        total += n
        step += n * in_step
        compiling += n * in_compiler
        step_compiling += n * (in_step and in_compiler)
        if in_compiler:
            frames = stack.split(";")
            ours = [f for f in frames if "kernels/" in f or "engine/" in f]
            callers[ours[-1] if ours else "?"] += n
    return {"samples": total, "compiler_samples": compiling, "compiler_share": compiling / max(total, 1),
            "step_thread_samples": step, "step_thread_compiler_samples": step_compiling,
            "step_thread_compiler_share": step_compiling / max(step, 1),
            "compiling_callers": dict(callers.most_common(8))}


def tree_summary(path: Path, spy: Path | None, deployment: str) -> dict:
    if not path.exists():
        return {"missing": str(path)}
    report = json.loads(path.read_text())
    dep = report.get("deployments", {}).get(deployment)
    if dep is None:
        return {"failed": report.get("failed", "no deployment result"), "log_tails": report.get("log_tails")}
    out: dict = {"product": dep.get("product"), "ready_s": dep.get("ready_s"), "argv": dep.get("argv"),
                 "compiles_after_warmup": dep.get("compiles_after_warmup"), "triton_kernels": dep.get("triton_kernels"),
                 "workload": report.get("workload")}
    for case, result in dep.items():
        if isinstance(result, dict) and "metrics" in result:
            out[case] = {k: result["metrics"].get(k) for k in METRICS}
            out[case]["failures"] = result.get("failures")
    if spy is not None:
        out["py_spy_prefill"] = spy_summary(spy / deployment / "prefill-0.txt")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--before-spy", type=Path, default=None)
    parser.add_argument("--after-spy", type=Path, default=None)
    parser.add_argument("--before-commit", default="")
    parser.add_argument("--after-commit", default="")
    parser.add_argument("--deployment", default="disaggregated")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = {"harness": "benchmarks/serving_gpu.py (this tree's) on both; deployments started by `pdserve serve`",
              "before": {"commit": args.before_commit,
                         **tree_summary(args.before, args.before_spy, args.deployment)},
              "after": {"commit": args.after_commit, **tree_summary(args.after, args.after_spy, args.deployment)}}
    report["compiles_after_warmup"] = {t: report[t].get("compiles_after_warmup") for t in ("before", "after")}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for tree in ("before", "after"):
        r = report[tree]
        cases = ", ".join(f"{c} TTFT p50/p99 {m['median_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms"
                          for c, m in r.items() if isinstance(m, dict) and "median_ttft_ms" in m)
        spy = r.get("py_spy_prefill", {})
        print(f"{tree}: {cases}; compiles_after_warmup {r.get('compiles_after_warmup')}; prefill step thread in "
              f"the compiler {spy.get('step_thread_compiler_share', float('nan')):.1%} of "
              f"{spy.get('step_thread_samples')} samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
