"""Serving on one H200 as a user starts it: `pdserve serve` as 1P + 1D processes sharing the GPU (KV by
cuda_ipc) and one `--colocated` worker, on the same ShareGPT requests, `--load-format dummy` llama3-8b in bf16,
beside the engine-bound figure for the same lengths (benchmarks/engine_bound.py, measured in this run).

    python benchmarks/serving_gpu.py --tokenizer DIR [--sharegpt PATH] [--num-prompts 1000] [--rate 20] \
        [--poisson-prompts 400] [--py-spy DIR] [--out benchmarks/results/serving_gpu_h200.json]

Cases, per deployment (each with its default flags: --max-num-seqs 256 on a GPU, CUDA graphs, async
scheduling, cuda_ipc between P and D, 0.4 of the GPU's memory each, 0.9 colocated):
  sharegpt      --num-prompts first exchanges of ../shared/data/sharegpt_v3_sample2k.json.gz (vLLM's filter),
                output lengths from the data set with ignore_eos, all at once: throughput
  poisson_<r>   --poisson-prompts others (another seed), Poisson arrivals at --rate req/s: latency
  poisson_<r>_t1  with --sampled: the same Poisson requests at temperature 1 (the API's default) instead of
                greedy: the sampler's stages run every step (its host copies must not stall the overlapped loop)
Dummy weights have no tokenizer. --tokenizer (the default model's) counts and encodes the prompts, which are
sent as token ids; the deployments detokenize with a word-level tokenizer over the model's whole vocabulary
(benchmarks/full_vocab_tokenizer.py), so every generated token is text and an event, as with real weights.
Recorded per case: `pdserve bench`'s metrics (vLLM's names), the decode worker's step phases, each process's
CPU seconds, and the ratio to the engine-bound figure. --py-spy DIR records the router and every worker of the
first deployment for the first 20 s of its sharegpt case (raw format, `py-spy record --format raw`).
--product DIR runs the deployments on another tree's product (DIR first on their PYTHONPATH, with
PYTHONSAFEPATH=1 so the working directory's pdserve/ does not shadow it: benchmarks/tree_link.py builds DIR),
the same harness and workload either way (issue 23's before/after). --triton-cache DIR gives the deployments
that Triton cache and records its compiled kernels (cache entries with a cubin) when the deployment is ready,
after the harness's warm-up requests and after each case: `compiles_after_warmup` is the count added from
ready to the last case (a kernel that one worker compiled and another then loaded from disk counts once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
from engine_bound import StepTable, measure_in_subprocess, replay
from full_vocab_tokenizer import write_tokenizer
from serving_common import Deployment, decode_counters, step_summary

from pdserve.bench.client import ApiTarget
from pdserve.bench.datasets import Conversation, LengthSpec, Turn, sample_random
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.runner import LoadSpec, run_benchmark
from pdserve.bench.sharegpt import load_sharegpt, sample_sharegpt
from pdserve.bench.tokenizer import CountingTokenizer, load_tokenizer
from pdserve.engine.presets import get_preset

REPO = Path(__file__).resolve().parents[1]
DEPLOYMENTS = {"disaggregated": [], "colocated": ["--colocated"],
               "disaggregated_fp8kv": ["--kv-cache-dtype", "fp8"],  # issue 19: the same with an fp8 KV cache
               "disaggregated_fp8kv_calc": ["--kv-cache-dtype", "fp8", "--calculate-kv-scales"]}  # scales calculated

Case = tuple[list[Conversation], LoadSpec, float]  # requests, arrivals, temperature
KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
        "median_e2el_ms")


def compiled_kernels(cache: Path | None) -> int | None:
    """Kernels in a Triton cache folder: its entries holding a cubin (None without a folder)."""
    if cache is None:
        return None
    return len({p.parent for p in cache.rglob("*.cubin")})


def run_case(dep: Deployment, convs: list[Conversation], load: LoadSpec, temperature: float = 0.0,
             spy: Path | None = None) -> dict:
    decode = next(w for w in dep.workers() if "decode" in w["roles"])
    before, cpu_before = decode_counters(decode["url"]), dep.child_cpu_seconds()
    spies = _py_spy(dep, spy) if spy is not None else []
    target = ApiTarget(dep.url, model=dep.model(), ignore_eos=True, temperature=temperature)
    result = asyncio.run(run_benchmark(convs, target, load,
                                       progress=False))
    for process in spies:
        process.wait(timeout=60)
    metrics = compute_metrics(result.outputs, result.duration, percentiles=[50, 99]).to_dict()
    cpu = {name: s - cpu_before.get(name, 0.0) for name, s in dep.child_cpu_seconds().items()}
    failures = [o.error for o in result.outputs if not o.success][:3]
    return {"metrics": {k: metrics[k] for k in KEYS}, "decode_steps": step_summary(before, decode_counters(decode["url"])),
            "process_cpu_s": cpu, "wall_s": result.duration, "failures": failures}


def _py_spy(dep: Deployment, out: Path) -> list[subprocess.Popen]:
    assert dep.process is not None
    processes = []
    for child in psutil.Process(dep.process.pid).children(recursive=True):
        argv = child.cmdline()
        name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "router"
        if name == "router" or name.startswith(("prefill", "decode", "colocated")):
            processes.append(subprocess.Popen(["py-spy", "record", "--format", "raw", "--duration", "20", "--pid",
                                               str(child.pid), "-o", str(out / f"{name}.txt")],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return processes


def run_deployment(name: str, args: argparse.Namespace, cases: dict[str, Case],
                   logs: Path, save: Callable[[dict], None] = lambda out: None) -> dict:
    """The deployment's cases in order; save(partial result) after each, so a run cut off keeps what it did."""
    flags = ["--load-format", "dummy", "--model-preset", args.model_preset, "--max-model-len", "4096",
             "--tokenizer", str(args.deployment_tokenizer), *DEPLOYMENTS[name]]
    env = {}
    if args.product is not None:
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(args.product), os.environ.get("PYTHONPATH")])),
               "PYTHONSAFEPATH": "1"}
    cache = None
    if args.triton_cache is not None:
        cache = args.triton_cache / name
        cache.mkdir(parents=True, exist_ok=True)
        env["TRITON_CACHE_DIR"] = str(cache)
    t0 = time.monotonic()
    with Deployment(args.port, flags, logs / f"{name}.log", env) as dep:
        out: dict = {"argv": dep.argv[2:], "ready_s": time.monotonic() - t0, "product": str(args.product or REPO),
                     "children": [" ".join(c.cmdline()[3:]) for c in psutil.Process(dep.process.pid).children()]}
        kernels = {"ready": compiled_kernels(cache)}
        # not measured: connections, caches, first-use costs
        asyncio.run(run_benchmark(sample_random(32, LengthSpec(128), LengthSpec(16), None, seed=5),
                                  ApiTarget(dep.url, model=dep.model(), ignore_eos=True), LoadSpec(math.inf),
                                  progress=False))
        kernels["after_harness_warm_up"] = compiled_kernels(cache)
        for case, (convs, load, temperature) in cases.items():
            spy = None
            if args.py_spy is not None and case == "sharegpt" and name == args.deployments[0]:
                spy = args.py_spy / name
                spy.mkdir(parents=True, exist_ok=True)
            out[case] = result = run_case(dep, convs, load, temperature, spy)
            kernels[f"after_{case}"] = compiled_kernels(cache)
            if cache is not None:
                out["triton_kernels"] = kernels
                out["compiles_after_warmup"] = kernels[f"after_{case}"] - kernels["ready"]
            save(out)
            print(f"{name} {case}: {_line(result)}", flush=True)
        if cache is not None:
            print(f"{name}: Triton kernels compiled {kernels}", flush=True)
    return out


def _line(case: dict) -> str:
    m, s = case["metrics"], case["decode_steps"]
    return (f"{m['completed']} done, {m['failed']} failed, {m['output_throughput']:.0f} out tok/s; TTFT p50/p99 "
            f"{m['median_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms, TPOT p50 {m['median_tpot_ms']:.2f} ms, ITL p50 "
            f"{m['median_itl_ms']:.2f} ms; decode batch {s['mean_batch']:.1f}, step {s['step_ms']:.2f} ms")


def workloads(args: argparse.Namespace) -> tuple[dict[str, Case], list]:
    tokenizer = load_tokenizer(args.tokenizer)
    data = load_sharegpt(args.sharegpt)
    sharegpt = as_token_ids(sample_sharegpt(data, args.num_prompts, tokenizer, seed=0), tokenizer)
    poisson = as_token_ids(sample_sharegpt(data, args.poisson_prompts, tokenizer, seed=1), tokenizer)
    lengths = [(c.turns[0].prompt_len, c.turns[0].output_len) for c in sharegpt]
    cases: dict[str, Case] = {"sharegpt": (sharegpt, LoadSpec(math.inf), 0.0)}
    if args.poisson_prompts > 0:
        cases[f"poisson_{args.rate:g}"] = (poisson, LoadSpec(args.rate, seed=1), 0.0)
        if args.sampled:
            cases[f"poisson_{args.rate:g}_t1"] = (poisson, LoadSpec(args.rate, seed=1), 1.0)
    return cases, lengths


def as_token_ids(convs: list[Conversation], tokenizer: CountingTokenizer) -> list[Conversation]:
    """Each prompt as the ids the default model's tokenizer gives it (the deployments' own tokenizer is
    word-level and would not split the text the same way)."""
    out = []
    for conv in convs:
        turn = conv.turns[0]
        assert isinstance(turn.prompt, str)
        ids = tokenizer.encode(turn.prompt, add_special_tokens=False)
        out.append(Conversation((Turn(ids, len(ids), turn.output_len),)))
    return out


def _save(report: dict, name: str, partial: dict, path: Path) -> None:
    report["deployments"][name] = partial
    path.write_text(json.dumps(report, indent=1))


def compare(report: dict, args: argparse.Namespace) -> None:
    """Ratios to the engine-bound figure, and the latency targets' terms (issue 15)."""
    table, bound = report.get("engine_table"), report.get("engine_bound")
    for result in report["deployments"].values():
        share = result.get("sharegpt")
        if share is not None and bound is not None:
            share["ratio_to_engine_bound"] = share["metrics"]["output_throughput"] / bound["output_tok_s"]
        for key in (f"poisson_{args.rate:g}", f"poisson_{args.rate:g}_t1"):
            poisson = result.get(key)
            if poisson is None or table is None:
                continue
            steps = StepTable.from_dict(table)
            graph_ms = steps.step_ms(poisson["decode_steps"]["mean_batch"], report["workload"]["mean_context"])
            m = poisson["metrics"]
            poisson["graph_step_ms_at_mean_batch"] = graph_ms
            # the graph the steps replayed (the bucket, padding included): its step, against the device's own
            # forward time per step (device_forward_ms), tells padding from a slowed device (a shared GPU)
            poisson["graph_step_ms_at_mean_bucket"] = steps.step_ms(
                poisson["decode_steps"].get("mean_forward_rows", 0) or poisson["decode_steps"]["mean_batch"],
                report["workload"]["mean_context"])
            poisson["tpot_over_graph_step"] = m["median_tpot_ms"] / graph_ms
            poisson["itl_over_tpot"] = m["median_itl_ms"] / max(m["median_tpot_ms"], 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="a directory with tokenizer.json that counts and encodes the prompts")
    parser.add_argument("--deployment-tokenizer", type=Path, default=None,
                        help="the deployments' tokenizer (default: a full-vocabulary word-level one, written now)")
    parser.add_argument("--sharegpt", type=Path, default=REPO.parent / "shared/data/sharegpt_v3_sample2k.json.gz")
    parser.add_argument("--model-preset", default="llama3-8b", help="smollm2-135m: the plumbing, on a CPU")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--poisson-prompts", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    parser.add_argument("--sampled", action="store_true", help="also the Poisson case at temperature 1")
    parser.add_argument("--deployments", nargs="+", default=["disaggregated", "colocated"], choices=list(DEPLOYMENTS))
    parser.add_argument("--no-engine-bound", action="store_true", help="skip the engine's step table (CPU runs)")
    parser.add_argument("--port", type=int, default=8741)
    parser.add_argument("--py-spy", type=Path, default=None)
    parser.add_argument("--product", type=Path, default=None,
                        help="run the deployments on this tree's product (a link tree: benchmarks/tree_link.py)")
    parser.add_argument("--triton-cache", type=Path, default=None,
                        help="the deployments' Triton cache (one subfolder each); counts compiles after ready")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serving_gpu_h200.json")
    args = parser.parse_args()
    # a SIGTERM (timeout's) unwinds like an exception, so `with Deployment` stops the workers it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(tempfile.mkdtemp(prefix="serving_gpu_"))
    if args.deployment_tokenizer is None:
        args.deployment_tokenizer = write_tokenizer(get_preset(args.model_preset).vocab_size, logs / "tokenizer")
    cases, lengths = workloads(args)
    prompt, output = sum(p for p, _ in lengths) / len(lengths), sum(o for _, o in lengths) / len(lengths)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": f"{args.model_preset} (dummy weights, bf16)",
                    "command": "python benchmarks/serving_gpu.py " + " ".join(sys.argv[1:]),
                    "workload": {"sharegpt_prompts": args.num_prompts, "poisson_prompts": args.poisson_prompts,
                                 "rate": args.rate, "mean_prompt_tokens": prompt, "mean_output_tokens": output,
                                 "mean_context": prompt + output / 2, "ignore_eos": True,
                                 "deployment_tokenizer": str(args.deployment_tokenizer)},
                    "deployments": {}}
    if not args.no_engine_bound:
        table = measure_in_subprocess(args.model_preset, logs / "engine_table.json")
        report["engine_table"] = table.to_dict()
        report["engine_bound"] = replay(lengths, table, max_num_seqs=256)
        print(f"engine-bound: {report['engine_bound']['output_tok_s']:.0f} out tok/s over the ShareGPT lengths "
              f"(mean prompt {prompt:.0f}, output {output:.0f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.deployments:
        try:
            report["deployments"][name] = run_deployment(name, args, cases, logs, lambda out, n=name: _save(
                report, n, out, args.out))
        except (RuntimeError, httpx.HTTPError) as exc:
            report["failed"] = f"{name}: {exc!r}"
            report["log_tails"] = {log.name: log.read_text()[-3000:] for log in logs.iterdir()}
            break
        compare(report, args)
        args.out.write_text(json.dumps(report, indent=1))
    args.out.write_text(json.dumps(report, indent=1))
    if "failed" in report:
        print(f"failed: {report['failed']}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
