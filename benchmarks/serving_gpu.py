"""Serving on one H200: `pdserve serve` as 1P + 1D processes sharing the GPU (KV by cuda_ipc) against one
`--colocated` worker, the same Poisson requests to each, `--load-format dummy` llama3-8b in bf16.

    python benchmarks/serving_gpu.py --tokenizer DIR [--num-prompts 200] [--input-len 1024] [--output-len 128] \
        [--rate 8 12] [--out benchmarks/results/serving_gpu_h200.json]

Dummy weights have no tokenizer; --tokenizer gives one (the default model's: prompts are random token ids
under its vocabulary, and the ids it does not know detokenise to nothing, which costs the router no less work).
Every deployment runs with its default flags otherwise: the launcher gives P and D 0.4 of the GPU's memory
each (0.9 for the colocated worker), CUDA graphs per decode bucket, and picks cuda_ipc for P -> D on a GPU.
Per rate: 200 random-token prompts (--input-len +-10 %), --output-len tokens each (ignore_eos), Poisson
arrivals; metrics are `pdserve bench`'s (vLLM's definitions), plus the decode worker's step counters.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from serving_common import Deployment
from serving_cpu import run_case

from pdserve.bench.datasets import LengthSpec, sample_random
from pdserve.bench.runner import LoadSpec

DEPLOYMENTS = {"disaggregated": [], "colocated": ["--colocated"]}


def run_deployment(name: str, args: argparse.Namespace, logs: Path) -> dict:
    flags = ["--load-format", "dummy", "--model-preset", args.model_preset, "--max-model-len", "4096",
             "--tokenizer", str(args.tokenizer), *DEPLOYMENTS[name]]
    t0 = time.monotonic()
    with Deployment(args.port, flags, logs / f"{name}.log") as dep:
        out: dict = {"argv": dep.argv[2:], "ready_s": time.monotonic() - t0,
                     "children": [" ".join(c.cmdline()[3:]) for c in psutil.Process(dep.process.pid).children()]}
        # not measured: 8 at once, then 24 arrivals of the measured kind (connections, caches, first-use costs)
        run_case(dep, sample_random(8, LengthSpec(args.input_len), LengthSpec(16), None, seed=5), LoadSpec(math.inf))
        warm = sample_random(24, LengthSpec(args.input_len, 0.1), LengthSpec(args.output_len), None, seed=6)
        run_case(dep, warm, LoadSpec(args.rate[0], seed=6))
        for rate in args.rate:
            convs = sample_random(args.num_prompts, LengthSpec(args.input_len, 0.1), LengthSpec(args.output_len),
                                  None, seed=1)
            case = run_case(dep, convs, LoadSpec(rate, seed=1))
            out[f"poisson_{rate:g}"] = case
            m, s = case["metrics"], case["decode_steps"]
            print(f"{name} {rate:g} req/s: {m['completed']} done, {m['failed']} failed; TTFT p50/p99 "
                  f"{m['median_ttft_ms']:.1f}/{m['p99_ttft_ms']:.1f} ms, TPOT {m['median_tpot_ms']:.2f}/"
                  f"{m['p99_tpot_ms']:.2f} ms, {m['output_throughput']:.0f} tok/s; decode batch "
                  f"{s['mean_batch']:.1f}, step {s['step_ms']:.2f} ms", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    parser.add_argument("--model-preset", default="llama3-8b", help="smollm2-135m: the plumbing, on a CPU")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rate", type=float, nargs="+", default=[8.0], help="Poisson arrivals per second")
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS))
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serving_gpu_h200.json"))
    args = parser.parse_args()
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": f"{args.model_preset} (dummy weights)",
                    "workload": {"num_prompts": args.num_prompts, "input_len": f"{args.input_len} +-10%",
                                 "output_len": args.output_len, "ignore_eos": True, "rates": args.rate},
                    "deployments": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="serving_gpu_"))
    for name in args.deployments:
        try:
            report["deployments"][name] = run_deployment(name, args, logs)
        except (RuntimeError, httpx.HTTPError) as exc:
            report["failed"] = f"{name}: {exc!r}"
            for log in logs.iterdir():
                report.setdefault("log_tails", {})[log.name] = log.read_text()[-3000:]
            break
        args.out.write_text(json.dumps(report, indent=1))
    args.out.write_text(json.dumps(report, indent=1))
    if "failed" in report:
        print(f"failed: {report['failed']}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
