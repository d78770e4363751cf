"""Issue 10's goodput sweep on a 2-GPU host: 1P (GPU 0) + 1D (GPU 1), KV by cuda_ipc over peer access,
against 2 colocated workers (one per GPU) behind the same router, the same Poisson workload at every rate.

    python benchmarks/two_gpu_serving.py --tokenizer DIR [--rates 1 2 4 6 8] [--num-prompts 200] \
        [--input-len 2048] [--output-len 256] [--goodput ttft:500 tpot:50] \
        [--out benchmarks/results/two_gpu_serving_h200.json]            (plots beside the JSON)

`--load-format dummy` llama3-8b (--model-preset), default flags otherwise: the launcher puts the workers
round-robin on the GPUs (prefill-0 -> cuda:0, decode-0 -> cuda:1; colocated-0/1 -> cuda:0/1). Goodput is
`pdserve bench`'s: completed requests per second that met every SLO. Not yet run: the 2-GPU kind was not
lent (issue 10). On a CPU, `--model-preset smollm2-135m --devices 0` runs the plumbing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

from serving_common import Deployment

from pdserve.bench.client import ApiTarget
from pdserve.bench.datasets import LengthSpec, sample_random
from pdserve.bench.metrics import SLOs, compute_metrics
from pdserve.bench.plots import plot_sweep
from pdserve.bench.runner import LoadSpec, run_benchmark

DEPLOYMENTS = {"1P+1D": [], "2x colocated": ["--colocated", "--num-colocated", "2"]}


def sweep(name: str, args: argparse.Namespace, slos: SLOs, logs: Path) -> list[dict]:
    flags = ["--load-format", "dummy", "--model-preset", args.model_preset, "--tokenizer", str(args.tokenizer),
             "--max-model-len", str(args.input_len * 2 + args.output_len), *DEPLOYMENTS[name]]
    if args.devices == 0:
        flags += ["--device", "cpu"]
    runs = []
    with Deployment(args.port, flags, logs / f"{name.replace(' ', '_')}.log") as dep:
        target = ApiTarget(dep.url, model=dep.model(), ignore_eos=True)
        warm = sample_random(16, LengthSpec(args.input_len, 0.1), LengthSpec(16), None, seed=5)
        asyncio.run(run_benchmark(warm, target, LoadSpec(math.inf), progress=False))
        for rate in args.rates:
            convs = sample_random(args.num_prompts, LengthSpec(args.input_len, 0.1), LengthSpec(args.output_len),
                                  None, seed=1)
            result = asyncio.run(run_benchmark(convs, target, LoadSpec(rate, seed=1), progress=False))
            metrics = compute_metrics(result.outputs, result.duration, slos, percentiles=[50, 99])
            runs.append({"rate": rate, "metrics": metrics.to_dict(), "_metrics": metrics})
            m = runs[-1]["metrics"]
            print(f"{name} {rate:g} req/s: goodput {m['request_goodput']:.2f} req/s, TTFT p99 {m['p99_ttft_ms']:.0f} "
                  f"ms, TPOT p99 {m['p99_tpot_ms']:.1f} ms", flush=True)
    return runs


def plot_goodput(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in report["deployments"].items():
        ax.plot([r["rate"] for r in runs], [r["metrics"]["request_goodput"] for r in runs], "o-", label=name)
    ax.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title=f"goodput at {report['slos']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    parser.add_argument("--model-preset", default="llama3-8b")
    parser.add_argument("--devices", type=int, default=2, help="0: the plumbing on a CPU")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 6.0, 8.0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--goodput", nargs="+", default=["ttft:500", "tpot:50"])
    parser.add_argument("--port", type=int, default=8751)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/two_gpu_serving_h200.json"))
    args = parser.parse_args()
    slos = SLOs.parse(args.goodput)
    logs = Path(tempfile.mkdtemp(prefix="two_gpu_serving_"))
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": f"{args.model_preset} (dummy weights)",
                    "slos": " ".join(args.goodput), "workload": {"num_prompts": args.num_prompts, "input_len":
                    f"{args.input_len} +-10%", "output_len": args.output_len, "rates": args.rates},
                    "deployments": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in DEPLOYMENTS:
        runs = sweep(name, args, slos, logs)
        plot_sweep([r["rate"] for r in runs], [r.pop("_metrics") for r in runs],
                   args.out.with_name(f"{args.out.stem}_{name.replace(' ', '_').replace('+', '')}.png"), name)
        report["deployments"][name] = runs
        args.out.write_text(json.dumps(report, indent=1))
    best = {name: max(r["metrics"]["request_goodput"] for r in runs) for name, runs in report["deployments"].items()}
    report["max_goodput"] = best
    report["disaggregated_over_colocated"] = best["1P+1D"] / best["2x colocated"] if best["2x colocated"] else None
    args.out.write_text(json.dumps(report, indent=1))
    plot_goodput(report, args.out.with_suffix(".png"))
    print(f"max goodput: {best}; ratio {report['disaggregated_over_colocated']}")


if __name__ == "__main__":
    main()
