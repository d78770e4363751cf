"""Does `pdserve plan`'s simulation predict a real deployment? Profile one worker, start router + 1 P + 1 D
(each worker pinned to its own cores), drive three workloads with the bench client, simulate the same split on
the requests actually sent (their send times and token counts), and compare p50 TTFT and p50 TPOT.

    python benchmarks/plan_validation.py --out benchmarks/results/plan_validation.json --tokenizer-dir DIR \
        [--threads 6] --model-args [--load-format dummy --model-preset smollm2-135m --tokenizer DIR]
    python benchmarks/plan_validation.py --cases small --out benchmarks/results/plan_validation_cpu.json \
        --tokenizer-dir ~/.cache/pdserve/models/smollm2-135m-instruct-*      # 2 cores, the default model
    python benchmarks/plan_validation.py --resimulate benchmarks/results/plan_validation_cpu.json   # ablation

With fewer than 2·threads + 2 cores the router (and this client) run unpinned and P, D get cores 0.. and
threads.. (on 2 cores: P on core 0, D on core 1). Per workload the P and D workers' own counters (/metrics:
forward seconds and forwards of P; steps, step phases and forward CPU time of D) are kept beside the
simulation's busy time of the same requests, so a miss can be told apart: the step model, or the queueing.

Two simulations per workload: `raw` uses the profile alone (model forward times, KV bytes / bandwidth);
`calibrated` adds what validation_calibration.py measures on the deployment before the workloads, with
requests unlike theirs: P's forward time over the profile's (single requests), the serving overheads per
request and per step, and how much slower each worker's model time is while the other one works beside it on
the same host (P and D share its caches and memory bandwidth), which the simulator applies only while the
other pool is busy. Nothing is fitted to the workloads' own results.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from serving_common import machine_load, wait_for_quiet
from validation_calibration import CLUSTER_KEYS, calibrate, prompt_len, simulate_sent, slowed
from validation_cluster import core_range, drive, spawn_pinned, start_cluster, stop_cluster, worker_counters

from pdserve.bench.client import RequestOutput
from pdserve.bench.datasets import Conversation, LengthSpec, sample_random
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.sharegpt import load_sharegpt, sample_sharegpt
from pdserve.bench.tokenizer import CountingTokenizer, load_tokenizer
from pdserve.decode_node.engine import STEP_PHASES as _PHASES
from pdserve.planner.profile import DECODE_TERMS, Profile, fit_linear
from pdserve.planner.simulator import ClusterSpec, SimResult, simulate
from pdserve.planner.workload import workload_from_lengths


@dataclass(frozen=True)
class WorkloadCase:
    name: str
    num_prompts: int
    rate: float
    input_len: int = 0  # random data set; 0: ShareGPT prompts
    output_len: int = 64
    range_ratio: float = 0.0
    burstiness: float = 1.0


CASES = {
    "default": [  # 16 cores, 6 threads a worker
        WorkloadCase("short-prompts", 60, 2.0, input_len=128, output_len=64, range_ratio=0.5),
        WorkloadCase("long-prompts", 40, 1.0, input_len=768, output_len=32, range_ratio=0.25),
        WorkloadCase("sharegpt-bursty", 60, 3.0, input_len=0, output_len=48, burstiness=0.5),
    ],
    # 2 cores, 1 thread a worker: a 128-token prefill takes ~0.5 s, a 512-token one ~2.5 s, a decode step
    # 70 ms at batch 1 and ~170 ms at batch 16 (SmolLM2-135M, fp32), so the rates keep P about half busy and
    # each workload near a minute
    "small": [
        WorkloadCase("short-prompts", 40, 1.0, input_len=128, output_len=32, range_ratio=0.5),
        WorkloadCase("long-prompts", 14, 0.25, input_len=512, output_len=24, range_ratio=0.25),
        WorkloadCase("sharegpt-bursty", 40, 0.6, input_len=0, output_len=32, burstiness=0.5),
    ],
}


def conversations(case: WorkloadCase, tokenizer: CountingTokenizer, sharegpt_path: str | None) -> list[Conversation]:
    if case.input_len:
        return sample_random(case.num_prompts, LengthSpec(case.input_len, case.range_ratio),
                             LengthSpec(case.output_len), tokenizer, seed=1)
    if sharegpt_path is None:
        raise SystemExit("the ShareGPT workload needs --sharegpt")
    return sample_sharegpt(load_sharegpt(sharegpt_path), case.num_prompts, tokenizer, seed=1,
                           output_len=case.output_len)


def step_summary(before: dict[str, float], after: dict[str, float], profile: Profile,
                 outputs: list[RequestOutput], sim: SimResult) -> dict[str, dict[str, float]]:
    """What the workers measured during a workload (their counters) beside what the simulation of the same
    requests spent: P forward seconds, D steps and step seconds. A step model that is right gives equal busy
    times; equal busy times with different latencies point at the queueing / batching instead."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = max(delta("pdserve_decode_steps"), 1.0)
    batch = delta("pdserve_decode_generated_tokens") / steps
    ctx = float(np.mean([prompt_len(o) + o.output_len / 2 for o in outputs]))
    decode = {"steps": delta("pdserve_decode_steps"), "mean_batch": batch,
              "mean_step_ms": 1000 * delta("pdserve_decode_step_seconds") / steps,
              "forward_cpu_ms": 1000 * delta("pdserve_decode_forward_cpu_seconds") / steps,
              "profile_step_ms_at_mean_batch": 1000 * profile.decode_time(round(batch), int(round(batch) * ctx)),
              "preemptions": delta("pdserve_decode_preemptions"),
              "busy_s": delta("pdserve_decode_step_seconds"), "sim_busy_s": sim.decode_busy_s,
              "sim_steps": sim.num_decode_steps}
    for phase in _PHASES:
        decode[f"{phase}_ms"] = 1000 * delta(f'pdserve_decode_step_phase_seconds{{phase="{phase}"}}') / steps
    forwards = max(delta("pdserve_prefill_forwards"), 1.0)
    prefill = {"forwards": delta("pdserve_prefill_forwards"), "computed_tokens": delta("pdserve_prefill_computed_tokens"),
               "mean_forward_ms": 1000 * delta("pdserve_prefill_forward_seconds") / forwards,
               "busy_s": delta("pdserve_prefill_forward_seconds"), "sim_busy_s": sim.prefill_busy_s}
    return {"prefill": prefill, "decode": decode}


def request_records(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    """What was sent and measured per request: enough to simulate the run again (--resimulate)."""
    return {"start_s": [o.start_time for o in outputs], "ttft_s": [o.ttft for o in outputs],
            "prompt_len": [prompt_len(o) for o in outputs],
            "output_len": [o.output_len for o in outputs], "latency_s": [o.latency for o in outputs]}


def summary_measured(outputs: list[RequestOutput], duration: float) -> dict[str, float]:
    m = compute_metrics(outputs, duration, percentiles=[50, 90])
    return {k: v for k, v in m.to_dict(("ttft", "tpot")).items() if k.startswith(("p50", "p90", "mean"))} | {
        "request_throughput": m.request_throughput, "completed": m.completed}


def summary_sim(r: SimResult) -> dict[str, float]:
    return {f"p{p}_{m}_ms": r.percentile_ms(m, p) for m in ("ttft", "tpot") for p in (50, 90)}


def run_profile(args: argparse.Namespace, logs: Path) -> Profile:
    """`pdserve profile` on P's cores with P's thread count, before the deployment starts (nothing else runs)."""
    if args.profile:
        return Profile.load(args.profile)
    path = logs / "profile.json"
    argv = [sys.executable, "-m", "pdserve.cli", "profile", "--device", "cpu", "--output", str(path),
            "--repeats", "2", *args.profile_args]
    proc = spawn_pinned(argv, core_range(0, args.threads), args.threads, logs / "profile.log")
    if proc.popen is None or proc.popen.wait() != 0:
        raise RuntimeError(f"pdserve profile failed: {(logs / 'profile.log').read_text()[-2000:]}")
    return Profile.load(path)


def compare(measured: dict[str, float], simulated: dict[str, float]) -> dict[str, float]:
    return {f"{k}_rel_error": abs(simulated[k] - measured[k]) / measured[k] for k in ("p50_ttft_ms", "p50_tpot_ms")}


def resimulate(path: str) -> int:
    """Simulate a saved validation run again (no server needed), adding per workload `ablation`: the p50s and
    errors with the calibration's terms added one at a time (and the calibrated one with the decode model's
    older four-term fit, refitted on the same samples), so what each term does can be read off."""
    report = json.loads(Path(path).read_text())
    profile = Profile.from_json(json.dumps(report["profile"]))
    cal = report["overheads_from_calibration"]
    full = ClusterSpec(**report["cluster"])
    base = ClusterSpec(**{k: v for k, v in report["cluster"].items() if k not in CLUSTER_KEYS})
    alone = replace(full, decode_slowdown_beside_prefill=1.0, prefill_slowdown_beside_decode=1.0)
    slow, four = slowed(profile, cal["prefill_slowdown_alone"]), _four_term(profile)
    variants = {"profile alone, four-term decode fit": (four, base), "profile alone": (profile, base),
                "+ P's slowdown alone, overheads": (slow, alone), "+ slowdowns beside the other pool": (slow, full),
                "calibrated, four-term decode fit": (slowed(four, cal["prefill_slowdown_alone"]), full)}
    for case in report["cases"]:
        rec = case["requests"]
        order = np.argsort(rec["start_s"], kind="stable")
        arrival = np.asarray(rec["start_s"])[order]
        workload = workload_from_lengths(arrival - arrival[0], [rec["prompt_len"][i] for i in order],
                                         [rec["output_len"][i] for i in order])
        case["ablation"] = {}
        for name, (prof, cluster) in variants.items():
            sim = summary_sim(simulate(prof, cluster, workload))
            case["ablation"][name] = sim | compare(case["measured"], sim)
        print(case["workload"]["name"])
        for name, row in case["ablation"].items():
            print(f"  {name:38s} TTFT {row['p50_ttft_ms']:6.0f} ({100 * row['p50_ttft_ms_rel_error']:3.0f}%)  "
                  f"TPOT {row['p50_tpot_ms']:5.0f} ({100 * row['p50_tpot_ms_rel_error']:3.0f}%)")
    Path(path).write_text(json.dumps(report, indent=1))
    return 0


def _four_term(profile: Profile) -> Profile:
    """The decode model without the multi_row term, fitted on the same samples."""
    features = np.array([s.features()[:4] for s in profile.decode_samples])
    seconds = np.array([s.seconds for s in profile.decode_samples])
    return replace(profile, decode=fit_linear(features, seconds, DECODE_TERMS[:4]))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--resimulate":
        return resimulate(sys.argv[2])
    args = parse_args()
    logs = Path(args.work_dir)
    logs.mkdir(parents=True, exist_ok=True)
    load_at_start = wait_for_quiet(args.max_load, args.max_wait)  # the machine is shared: start when it is quiet
    profile = run_profile(args, logs)
    cluster = ClusterSpec(1, 1, args.max_num_batched_tokens, args.max_num_seqs, args.num_blocks,
                          profile.block_size, args.kv_bandwidth_gbps * 1e9, args.kv_latency_ms / 1e3)
    tokenizer = load_tokenizer(args.tokenizer_dir)
    procs = start_cluster(args, logs)
    url = f"http://127.0.0.1:{args.port}"
    try:
        overheads = calibrate(profile, cluster, url, tokenizer)
        print("calibration:", json.dumps(overheads), "load", machine_load(), flush=True)
        calibrated = replace(cluster, **{k: v for k, v in overheads.items() if k in CLUSTER_KEYS})
        slowed_profile = slowed(profile, overheads["prefill_slowdown_alone"])
        cases = [run_case(case, url, args, tokenizer, profile, cluster, calibrated, slowed_profile)
                 for case in CASES[args.cases]]
    finally:
        stop_cluster(procs)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": args.machine, "command": shlex.join(sys.argv),
              "worker_env": args.worker_env, "load_at_start": load_at_start, "load_at_end": machine_load(),
              "profile": json.loads(profile.to_json()),
              "cluster": asdict(calibrated), "overheads_from_calibration": overheads, "cases": cases,
              "within_25pct_calibrated": all(v <= 0.25 for c in cases for v in c["error_calibrated"].values()),
              "within_25pct_raw": all(v <= 0.25 for c in cases for v in c["error_raw"].values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"saved {args.out}; within 25% (calibrated): {report['within_25pct_calibrated']}, "
          f"(raw): {report['within_25pct_raw']}")
    return 0


def run_case(case: WorkloadCase, url: str, args: argparse.Namespace, tokenizer: CountingTokenizer,
             profile: Profile, cluster: ClusterSpec, calibrated: ClusterSpec, slowed_profile: Profile) -> dict:
    """`raw`: the profile alone; `calibrated`: with what validation_calibration.py measured."""
    load_before, before = machine_load(), worker_counters(url)
    outputs, duration = drive(url, conversations(case, tokenizer, args.sharegpt), case.rate, case.burstiness)
    measured = summary_measured(outputs, duration)
    raw_sim, cal_sim = simulate_sent(profile, cluster, outputs), simulate_sent(slowed_profile, calibrated, outputs)
    # the raw simulation's busy time is the profile's forwards alone: compared with P's forward seconds and
    # D's step seconds (its phases say how much of a step is the forward)
    measured["workers"] = step_summary(before, worker_counters(url), profile, outputs, raw_sim)
    for pool in ("prefill", "decode"):  # the calibrated model's busy time too, and the part beside the other pool
        measured["workers"][pool]["sim_calibrated_busy_s"] = getattr(cal_sim, f"{pool}_busy_s")
    measured["workers"]["prefill"]["sim_calibrated_beside_s"] = cal_sim.prefill_busy_beside_decode_s
    measured["workers"]["decode"]["sim_calibrated_beside_s"] = cal_sim.decode_busy_beside_prefill_s
    measured["decode_steps"] = measured["workers"]["decode"]  # the key --resimulate reads
    raw, cal = summary_sim(raw_sim), summary_sim(cal_sim)
    out = {"workload": asdict(case), "load_before": load_before, "load_after": machine_load(),
           "requests": request_records(outputs), "measured": measured, "simulated_raw": raw,
           "simulated_calibrated": cal, "error_raw": compare(measured, raw), "error_calibrated": compare(measured, cal)}
    print(json.dumps({k: v for k, v in out.items() if k != "requests"}, indent=1), flush=True)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/plan_validation.json")
    p.add_argument("--work-dir", default="/tmp/plan_validation")
    p.add_argument("--machine", default="this machine (CPU)")
    p.add_argument("--port", type=int, default=8411)
    p.add_argument("--threads", type=int, default=1, help="cores (and torch threads) per worker")
    p.add_argument("--cases", choices=sorted(CASES), default="default",
                   help="workload sizes: default (16 cores), small (2 cores, one thread a worker)")
    p.add_argument("--profile", default=None, help="a saved `pdserve profile` JSON instead of profiling first")
    p.add_argument("--profile-args", default="", help="extra flags of `pdserve profile`, in one string, e.g. "
                                                        "'--decode-batches 1,2,4,8,16,32'")
    p.add_argument("--tokenizer-dir", required=True, help="the model's tokenizer directory")
    p.add_argument("--sharegpt", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" /
                                             "sharegpt_v3_sample2k.json.gz"))
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for the router and workers (last on the line), e.g. --load-format dummy ...")
    p.add_argument("--worker-env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="environment of the P and D processes, e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--max-load", type=float, default=1.0, help="wait for the 1-minute load to drop to this")
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for --max-load at most")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--kv-bandwidth-gbps", type=float, default=2.0, help="TCP over loopback")
    p.add_argument("--kv-latency-ms", type=float, default=1.0)
    args = p.parse_args()
    preset = [a for i, a in enumerate(args.model_args[1:]) if args.model_args[i] == "--model-preset"]
    args.profile_args = [*shlex.split(args.profile_args), *(["--model-preset", preset[0]] if preset else [])]
    return args


if __name__ == "__main__":
    sys.exit(main())
