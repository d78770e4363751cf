"""Does `pdserve plan`'s simulation predict a real deployment? Profile one worker, start router + 1 P + 1 D
(each pinned to its own cores), drive three workloads with the bench client, simulate the same split on the
requests actually sent (their send times and token counts), and compare p50 TTFT and p50 TPOT.

    python benchmarks/plan_validation.py --out benchmarks/results/plan_validation.json --tokenizer-dir DIR \
        [--threads 6] --model-args [--load-format dummy --model-preset smollm2-135m --tokenizer DIR]
    python benchmarks/plan_validation.py --resimulate benchmarks/results/plan_validation.json

Two simulations per workload: `raw` uses the profile alone (model forward times, KV bytes / bandwidth);
`calibrated` adds the per-step serving overheads (scheduling, sampling, streaming; HTTP hops) measured on a
separate calibration run of single requests, as `pdserve plan --prefill-overhead-ms/--decode-overhead-ms/
--router-overhead-ms` take them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.client import ApiTarget, RequestOutput
from pdserve.bench.datasets import Conversation, LengthSpec, sample_random
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.runner import LoadSpec, run_benchmark
from pdserve.bench.sharegpt import load_sharegpt, sample_sharegpt
from pdserve.bench.tokenizer import CountingTokenizer, load_tokenizer
from pdserve.planner.profile import Profile
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


CASES = [
    WorkloadCase("short-prompts", 60, 2.0, input_len=128, output_len=64, range_ratio=0.5),
    WorkloadCase("long-prompts", 40, 1.0, input_len=768, output_len=32, range_ratio=0.25),
    WorkloadCase("sharegpt-bursty", 60, 3.0, input_len=0, output_len=48, burstiness=0.5),
]


def _cpus(first: int, count: int) -> str:
    return f"{first}-{first + count - 1}"


def _spawn(argv: list[str], cpus: str, threads: int, log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           **(extra_env or {})}
    pin = ["taskset", "-c", cpus] if shutil.which("taskset") else []  # pinning keeps P and D off each other's cores
    return subprocess.Popen([*pin, *argv], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 300.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server process exited early (codes {[p.poll() for p in procs]})")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def start_cluster(args: argparse.Namespace, logs: Path) -> list[subprocess.Popen]:
    """Router on 2 cores, P and D on `threads` cores each."""
    base = [sys.executable, "-m", "pdserve.cli"]
    model = args.model_args
    url = f"http://127.0.0.1:{args.port}"
    t = args.threads
    procs = [_spawn([*base, "router", "--port", str(args.port), *model], _cpus(2 * t, 2), 2, logs / "router.log")]
    time.sleep(3.0)
    engine = ["--device", "cpu", "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
              str(args.max_num_batched_tokens), "--num-blocks", str(args.num_blocks)]
    env = dict(item.split("=", 1) for item in args.worker_env)
    procs.append(_spawn([*base, "prefill", "--role", "prefill", "--router", url, "--port", "0", *model, *engine],
                        _cpus(0, t), t, logs / "prefill.log", env))
    procs.append(_spawn([*base, "decode", "--role", "decode", "--router", url, "--port", "0", *model, *engine],
                        _cpus(t, t), t, logs / "decode.log", env))
    _wait_ready(url, procs)
    return procs


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def conversations(case: WorkloadCase, tokenizer: CountingTokenizer, sharegpt_path: str | None) -> list[Conversation]:
    if case.input_len:
        return sample_random(case.num_prompts, LengthSpec(case.input_len, case.range_ratio),
                             LengthSpec(case.output_len), tokenizer, seed=1)
    if sharegpt_path is None:
        raise SystemExit("the ShareGPT workload needs --sharegpt")
    return sample_sharegpt(load_sharegpt(sharegpt_path), case.num_prompts, tokenizer, seed=1,
                           output_len=case.output_len)


def drive(url: str, convs: list[Conversation], rate: float, burstiness: float,
          max_concurrency: int | None = None) -> tuple[list[RequestOutput], float]:
    target = ApiTarget(url, "/v1/completions", model=_model_name(url), ignore_eos=True)
    load = LoadSpec(rate, burstiness, max_concurrency, seed=1)
    result = asyncio.run(run_benchmark(convs, target, load, progress=False))
    failed = [o.error for o in result.outputs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    return result.outputs, result.duration


def _model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


_DECODE_COUNTERS = ("pdserve_decode_steps", "pdserve_decode_generated_tokens", "pdserve_decode_step_seconds",
                    "pdserve_decode_preemptions")


def decode_counters(url: str) -> dict[str, float]:
    """The decode worker's step counters (its /metrics), found through the router's worker list."""
    workers = httpx.get(url + "/internal/workers", timeout=10).json()["workers"]
    d_url = next(w["url"] for w in workers if "decode" in w["roles"])
    values: dict[str, float] = {}
    for line in httpx.get(d_url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.removesuffix("_total") in _DECODE_COUNTERS:
            values[name.removesuffix("_total")] = float(value)
    return values


def step_summary(before: dict[str, float], after: dict[str, float], profile: Profile,
                 outputs: list[RequestOutput]) -> dict[str, float]:
    """Server-side decode steps during a workload, and what the profile says a step of that batch costs."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _DECODE_COUNTERS}
    steps = max(delta["pdserve_decode_steps"], 1.0)
    batch = delta["pdserve_decode_generated_tokens"] / steps
    ctx = float(np.mean([(o.prompt_len or o.server_prompt_tokens) + o.output_len / 2 for o in outputs]))
    return {"steps": steps, "mean_batch": batch, "mean_step_ms": 1000 * delta["pdserve_decode_step_seconds"] / steps,
            "profile_step_ms_at_mean_batch": 1000 * profile.decode_time(round(batch), int(round(batch) * ctx)),
            "preemptions": delta["pdserve_decode_preemptions"]}


def simulate_sent(profile: Profile, cluster: ClusterSpec, outputs: list[RequestOutput]) -> SimResult:
    order = np.argsort([o.start_time for o in outputs])
    arrivals = np.array([outputs[i].start_time for i in order])
    workload = workload_from_lengths(arrivals - arrivals[0], [outputs[i].prompt_len or outputs[i].server_prompt_tokens
                                                              for i in order], [outputs[i].output_len for i in order])
    return simulate(profile, cluster, workload)


def request_records(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    """What was sent and measured per request: enough to simulate the run again (--resimulate)."""
    return {"start_s": [o.start_time for o in outputs], "ttft_s": [o.ttft for o in outputs],
            "prompt_len": [o.prompt_len or o.server_prompt_tokens for o in outputs],
            "output_len": [o.output_len for o in outputs], "latency_s": [o.latency for o in outputs]}


def summary_measured(outputs: list[RequestOutput], duration: float) -> dict[str, float]:
    m = compute_metrics(outputs, duration, percentiles=[50, 90])
    return {k: v for k, v in m.to_dict(("ttft", "tpot")).items() if k.startswith(("p50", "p90", "mean"))} | {
        "request_throughput": m.request_throughput, "completed": m.completed}


def summary_sim(r: SimResult) -> dict[str, float]:
    return {f"p{p}_{m}_ms": r.percentile_ms(m, p) for m in ("ttft", "tpot") for p in (50, 90)}


def calibrate(profile: Profile, cluster: ClusterSpec, url: str, tokenizer: CountingTokenizer) -> dict[str, float]:
    """Serving overheads the profile (model forwards alone) does not see, from two runs unlike the workloads:
    single requests one at a time give the overhead per P iteration (TTFT, router hops included) and per D
    step (TPOT at batch 1); then 8 requests at once give the overhead per sequence of a D step."""
    convs = sample_random(8, LengthSpec(256, 0.5), LengthSpec(32), tokenizer, seed=7)
    outputs, _ = drive(url, convs, rate=float("inf"), burstiness=1.0, max_concurrency=1)
    ideal = simulate_sent(profile, cluster, [replace(o, start_time=10.0 * i) for i, o in enumerate(outputs)])
    single = {"prefill_overhead_s": max(0.0, float(np.median([o.ttft for o in outputs]) - np.median(ideal.ttft))),
              "decode_overhead_s": max(0.0, float(np.median([_tpot(o) for o in outputs]) - np.median(ideal.tpot)))}
    batch = sample_random(8, LengthSpec(64), LengthSpec(48), tokenizer, seed=8)
    outputs, _ = drive(url, batch, rate=float("inf"), burstiness=1.0)
    sim = simulate_sent(profile, replace(cluster, **single), outputs)
    extra = float(np.median([_tpot(o) for o in outputs]) - np.median(sim.tpot))
    return single | {"decode_overhead_per_seq_s": max(0.0, extra / len(batch))}


def _tpot(o: RequestOutput) -> float:
    return (o.latency - o.ttft) / (o.output_len - 1)


def run_profile(args: argparse.Namespace, logs: Path) -> Profile:
    path = logs / "profile.json"
    argv = [sys.executable, "-m", "pdserve.cli", "profile", "--device", "cpu", "--output", str(path),
            "--repeats", "2", *args.profile_args]
    proc = _spawn(argv, _cpus(0, args.threads), args.threads, logs / "profile.log")
    if proc.wait() != 0:
        raise RuntimeError(f"pdserve profile failed: {(logs / 'profile.log').read_text()[-2000:]}")
    return Profile.load(path)


def compare(measured: dict[str, float], simulated: dict[str, float]) -> dict[str, float]:
    return {f"{k}_rel_error": abs(simulated[k] - measured[k]) / measured[k] for k in ("p50_ttft_ms", "p50_tpot_ms")}


def resimulate(path: str) -> int:
    """Simulate a saved validation run again (no server needed), adding the `step_corrected` diagnosis: the
    decode model scaled so a step of the workload's mean batch costs what the decode worker's own counters
    measured (mean_step_ms). If the simulation then matches, its queueing and batching are right and the gap
    is in step cost the in-process profile does not see (on a shared CPU: the worker's other threads)."""
    report = json.loads(Path(path).read_text())
    profile = Profile.from_json(json.dumps(report["profile"]))
    cluster = ClusterSpec(**report["cluster"])
    for case in report["cases"]:
        rec, steps = case["requests"], case["measured"]["decode_steps"]
        scale = steps["mean_step_ms"] / steps["profile_step_ms_at_mean_batch"]
        a, b, c = profile.decode.coef
        scaled = replace(profile, decode=replace(profile.decode, coef=(a * scale, b * scale, c * scale)))
        workload = workload_from_lengths(np.asarray(rec["start_s"]) - min(rec["start_s"]), rec["prompt_len"],
                                         rec["output_len"])
        order = np.argsort(workload.arrival, kind="stable")
        workload = workload_from_lengths(workload.arrival[order], list(workload.input_len[order]),
                                         list(workload.output_len[order]))
        sim = simulate(scaled, replace(cluster, decode_overhead_s=0.0, decode_overhead_per_seq_s=0.0), workload)
        case["decode_scale_from_counters"] = scale
        case["simulated_step_corrected"] = summary_sim(sim)
        case["error_step_corrected"] = compare(case["measured"], case["simulated_step_corrected"])
    report["within_25pct_step_corrected"] = all(v <= 0.25 for c in report["cases"]
                                                for v in c["error_step_corrected"].values())
    Path(path).write_text(json.dumps(report, indent=1))
    for case in report["cases"]:
        print(case["workload"]["name"], {k: round(v, 3) for k, v in case["error_step_corrected"].items()})
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--resimulate":
        return resimulate(sys.argv[2])
    args = parse_args()
    logs = Path(args.work_dir)
    logs.mkdir(parents=True, exist_ok=True)
    profile = run_profile(args, logs)
    cluster = ClusterSpec(1, 1, args.max_num_batched_tokens, args.max_num_seqs, args.num_blocks,
                          profile.block_size, args.kv_bandwidth_gbps * 1e9, args.kv_latency_ms / 1e3)
    tokenizer = load_tokenizer(args.tokenizer_dir)
    procs = start_cluster(args, logs)
    url = f"http://127.0.0.1:{args.port}"
    try:
        overheads = calibrate(profile, cluster, url, tokenizer)
        calibrated = replace(cluster, **overheads)
        cases = []
        for case in CASES:
            before = decode_counters(url)
            outputs, duration = drive(url, conversations(case, tokenizer, args.sharegpt), case.rate, case.burstiness)
            measured = summary_measured(outputs, duration)
            measured["decode_steps"] = step_summary(before, decode_counters(url), profile, outputs)
            raw, cal = summary_sim(simulate_sent(profile, cluster, outputs)), summary_sim(
                simulate_sent(profile, calibrated, outputs))
            cases.append({"workload": asdict(case), "requests": request_records(outputs), "measured": measured,
                          "simulated_raw": raw,
                          "simulated_calibrated": cal, "error_raw": compare(measured, raw),
                          "error_calibrated": compare(measured, cal)})
            print(json.dumps(cases[-1], indent=1), flush=True)
    finally:
        stop_cluster(procs)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": args.machine, "command": " ".join(sys.argv),
              "worker_env": args.worker_env,
              "profile": json.loads(profile.to_json()),
              "cluster": asdict(calibrated), "overheads_from_calibration": overheads, "cases": cases,
              "within_25pct_calibrated": all(v <= 0.25 for c in cases for v in c["error_calibrated"].values()),
              "within_25pct_raw": all(v <= 0.25 for c in cases for v in c["error_raw"].values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"saved {args.out}; within 25% (calibrated): {report['within_25pct_calibrated']}, "
          f"(raw): {report['within_25pct_raw']}")
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/plan_validation.json")
    p.add_argument("--work-dir", default="/tmp/plan_validation")
    p.add_argument("--machine", default="this machine (CPU)")
    p.add_argument("--port", type=int, default=8411)
    p.add_argument("--threads", type=int, default=1, help="cores (and torch threads) per worker")
    p.add_argument("--tokenizer-dir", required=True, help="the model's tokenizer directory")
    p.add_argument("--sharegpt", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" /
                                             "sharegpt_v3_sample2k.json.gz"))
    p.add_argument("--model-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for the router and workers (last on the line), e.g. --load-format dummy ...")
    p.add_argument("--worker-env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="environment of the P and D processes, e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--kv-bandwidth-gbps", type=float, default=2.0, help="TCP over loopback")
    p.add_argument("--kv-latency-ms", type=float, default=1.0)
    args = p.parse_args()
    preset = [a for i, a in enumerate(args.model_args[1:]) if args.model_args[i] == "--model-preset"]
    args.profile_args = ["--model-preset", preset[0]] if preset else []
    return args


if __name__ == "__main__":
    sys.exit(main())
