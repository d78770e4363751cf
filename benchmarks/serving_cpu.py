"""Serving on this CPU machine, one run: 1P+1D (`pdserve serve`) against one colocated worker
(`pdserve serve --colocated`) on the same requests, and the router's added latency per token.

    .venv/bin/python benchmarks/serving_cpu.py [--num-prompts 64] [--input-len 200] [--output-len 64] \
        [--rate 0.2] [--relay-prompts 12] [--max-load 3] [--out benchmarks/results/serving_cpu.json]

Each deployment (default model, default flags: the launcher gives each worker its share of the cores) serves:
  poisson   --num-prompts random-token prompts (--input-len ±10%), --output-len tokens each (ignore_eos),
            Poisson arrivals at --rate req/s: loaded, not collapsing;
  max       the same prompts (another seed) all at once: the most concurrency the deployment takes;
  relay     --relay-prompts requests through the router and as many driven straight through the workers'
            internal API (reserve on D, D's stream, P's prefill), all at once, in the same decode batches.
The relay case gives the ITL seen through the router and straight from D, and the router's delay per token:
D sends every running request's frame of a step at once, so a routed token's arrival minus the first
arrival of a direct frame of the same step is what the hop through the router added (client parsing of
the frames of one step included, so this is an upper bound). The paired figure takes, per step, the median
routed arrival minus the median direct arrival: the client's own parsing delays both kinds alike and cancels.

Metrics are `pdserve bench`'s (vLLM's definitions); the decode worker's step counters (mean batch, step time
by phase, forward CPU time) are read from its /metrics around every case. The 1-minute load average is
recorded before and after every case: other sessions share these 2 cores, so compare the two deployments
within one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from serving_common import (
    Deployment,
    DirectLinks,
    DirectOutput,
    decode_counters,
    direct_request,
    machine_load,
    step_summary,
    wait_for_quiet,
)

from pdserve.bench.client import ApiTarget, RequestOutput, send_request
from pdserve.bench.datasets import Conversation, LengthSpec, PromptMaker, sample_random
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.runner import LoadSpec, run_benchmark

DEPLOYMENTS = {"disaggregated": [], "colocated": ["--colocated"]}
CASES = ("poisson", "max", "relay")
_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
         "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


def prompts(args: argparse.Namespace, seed: int) -> list[Conversation]:
    return sample_random(args.num_prompts, LengthSpec(args.input_len, 0.1), LengthSpec(args.output_len), None, seed)


def run_case(dep: Deployment, convs: list[Conversation], load: LoadSpec) -> dict:
    decode_url = dep.worker_url("decode")
    before, load_before = decode_counters(decode_url), machine_load()
    target = ApiTarget(dep.url, model=dep.model(), ignore_eos=True)
    result = asyncio.run(run_benchmark(convs, target, load, progress=False))
    metrics = compute_metrics(result.outputs, result.duration, percentiles=[50, 99]).to_dict()
    return {"metrics": {k: metrics[k] for k in _KEYS}, "decode_steps": step_summary(before, decode_counters(decode_url)),
            "load_before": load_before, "load_after": machine_load()}


# ---- relay: the router's added latency per token ------------------------------------------------------------

def routed_times(out: RequestOutput, t0: float) -> list[float]:
    """Arrival times of a routed request's chunks, the first (TTFT) left out."""
    first = t0 + out.start_time + out.ttft
    return list(first + np.cumsum(out.itl)) if out.itl else []


def step_starts(direct: list[DirectOutput], gap_s: float) -> list[float]:
    """The first arrival of each decode step's direct frames (each request's first frame, from P, left out)."""
    times = sorted(t for out in direct for t in out.frame_times[1:])
    return [t for i, t in enumerate(times) if i == 0 or t - times[i - 1] > gap_s]


def relay_delays(routed: list[list[float]], starts: list[float], max_s: float) -> list[float]:
    """Each routed token's arrival minus the start of the step it came from (the latest start before it)."""
    delays = []
    for times in routed:
        for t in times:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t - starts[i] < max_s:
                delays.append(t - starts[i])
    return delays


def step_offsets(routed: list[list[float]], direct: list[DirectOutput], starts: list[float],
                 max_s: float) -> list[float]:
    """Per decode step, the median arrival of its routed tokens minus the median arrival of its direct frames.

    The client reads both kinds in one process, in the order they come: its parsing of a step's earlier frames
    delays the later ones whichever way they came, so it adds to both medians alike and cancels here, while
    `relay_delays` counts it against the router."""
    steps: dict[int, tuple[list[float], list[float]]] = collections.defaultdict(lambda: ([], []))
    for side, arrivals in ((0, [t for times in routed for t in times]),
                           (1, [t for out in direct for t in out.frame_times[1:]])):
        for t in arrivals:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t - starts[i] < max_s:
                steps[i][side].append(t)
    return [statistics.median(r) - statistics.median(d) for r, d in steps.values() if r and d]


async def _relay_requests(dep: Deployment, ids: list[list[int]], output_len: int):
    target = ApiTarget(dep.url, model=dep.model(), ignore_eos=True)
    limits = httpx.Limits(max_connections=2 * len(ids), max_keepalive_connections=2 * len(ids))
    links = await DirectLinks.open(dep)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
            t0 = time.perf_counter()
            # alternate routed and direct, so that both kinds are prefilled alike and decode in the same batches
            tasks = [send_request(http, target, p, output_len, len(p), t0) if i % 2 == 0 else
                     direct_request(links, p, output_len) for i, p in enumerate(ids)]
            done = await asyncio.gather(*tasks)
    finally:
        links.close()
    return t0, done[0::2], done[1::2]


def relay_case(dep: Deployment, num: int, args: argparse.Namespace) -> dict:
    maker = PromptMaker(None, np.random.default_rng(99))
    ids = [maker.random_ids(args.input_len) for _ in range(2 * num)]
    load_before, cpu_before = machine_load(), dep.child_cpu_seconds()
    t0, routed, direct = asyncio.run(_relay_requests(dep, ids, args.output_len))
    cpu = {name: seconds - cpu_before.get(name, 0.0) for name, seconds in dep.child_cpu_seconds().items()}
    errors = [o.error for o in routed if not o.success] + [o.error for o in direct if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} relay requests failed, first: {errors[0]}")
    itl_routed = [x for o in routed for x in o.itl]
    itl_direct = [b - a for o in direct for a, b in zip(o.frame_times[1:], o.frame_times[2:])]
    starts = step_starts(direct, gap_s=0.02)
    routed_arrivals, max_s = [routed_times(o, t0) for o in routed], 0.5 * statistics.median(itl_direct)
    delays = relay_delays(routed_arrivals, starts, max_s)
    offsets = step_offsets(routed_arrivals, direct, starts, max_s)
    return {"requests_routed": len(routed), "requests_direct": len(direct),
            "itl_routed_ms": _stats(itl_routed), "itl_direct_ms": _stats(itl_direct),
            "relay_delay_ms": _stats(delays), "tokens_matched": len(delays),
            "relay_step_offset_ms": _stats(offsets),
            "tokens_routed": sum(len(o.itl) for o in routed), "process_cpu_s": cpu,
            # the router's CPU time per token it relayed (every routed token: its only work in this case)
            "router_cpu_ms_per_token": 1000 * cpu["router"] / max(1, sum(o.output_len for o in routed)),
            "load_before": load_before, "load_after": machine_load()}


def _stats(values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [math.nan]) * 1000.0
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean()), "n": len(values_s)}


# ---- the run ---------------------------------------------------------------------------------------------------

def run_deployment(name: str, args: argparse.Namespace, logs: Path) -> dict:
    env = dict(item.split("=", 1) for item in args.deployment_env)
    with Deployment(args.port, DEPLOYMENTS[name], logs / f"{name}.log", env) as dep:
        warm = sample_random(2, LengthSpec(args.input_len), LengthSpec(8), None, seed=5)
        run_case(dep, warm, LoadSpec(math.inf))
        out: dict = {"argv": dep.argv[2:], "env": env}
        if "poisson" in args.cases:
            out["poisson"] = run_case(dep, prompts(args, seed=1), LoadSpec(args.rate, seed=1))
            print(f"{name} poisson: {_line(out['poisson'])}", flush=True)
        if "max" in args.cases:
            out["max"] = run_case(dep, prompts(args, seed=2), LoadSpec(math.inf))
            print(f"{name} max: {_line(out['max'])}", flush=True)
        for streams in args.relay_sweep:  # the router's delay against how many streams it relays at once
            out.setdefault("relay_by_streams", {})[str(streams)] = case = relay_case(dep, streams, args)
            print(f"{name} relay, {streams} routed streams: per step p50 {case['relay_step_offset_ms']['p50']:.2f} "
                  f"ms, upper bound p50 {case['relay_delay_ms']['p50']:.2f} ms", flush=True)
        if "relay" in args.cases and args.relay_prompts:
            out["relay"] = relay_case(dep, args.relay_prompts, args)
            print(f"{name} relay: upper bound {json.dumps(out['relay']['relay_delay_ms'])}, per step "
                  f"{json.dumps(out['relay']['relay_step_offset_ms'])}, router CPU "
                  f"{out['relay']['router_cpu_ms_per_token']:.2f} ms/token", flush=True)
    return out


def _line(case: dict) -> str:
    m, s = case["metrics"], case["decode_steps"]
    return (f"ttft p50 {m['median_ttft_ms']:.0f} ms, tpot p50 {m['median_tpot_ms']:.0f} ms, "
            f"{m['output_throughput']:.1f} tok/s, batch {s['mean_batch']:.1f}, step {s['step_ms']:.0f} ms")


def print_table(report: dict) -> None:
    if not all(case in d for d in report["deployments"].values() for case in ("poisson", "max")):
        return  # a partial run (--cases): the JSON and the lines above hold it
    rows = [("TTFT p50 / p99 (ms)", "median_ttft_ms", "p99_ttft_ms"), ("TPOT p50 / p99 (ms)", "median_tpot_ms",
            "p99_tpot_ms"), ("ITL p50 / p99 (ms)", "median_itl_ms", "p99_itl_ms")]
    names = list(report["deployments"])
    print(f"\n{'':28}" + "".join(f"{n + ' ' + c:>28}" for c in ("poisson", "max") for n in names))
    for label, a, b in rows:
        cells = [report["deployments"][n][c]["metrics"] for c in ("poisson", "max") for n in names]
        print(f"{label:28}" + "".join(f"{m[a]:>18.0f} / {m[b]:<7.0f}" for m in cells))
    for label, key in (("requests/s", "request_throughput"), ("output tokens/s", "output_throughput")):
        cells = [report["deployments"][n][c]["metrics"][key] for c in ("poisson", "max") for n in names]
        print(f"{label:28}" + "".join(f"{v:>28.2f}" for v in cells))
    cells = [report["deployments"][n][c]["decode_steps"] for c in ("poisson", "max") for n in names]
    print(f"{'decode batch / step ms':28}" + "".join(f"{s['mean_batch']:>18.1f} / {s['step_ms']:<7.0f}" for s in cells))
    for name in names:
        relay = report["deployments"][name].get("relay")
        if relay:
            print(f"\n{name}: ITL p50 routed {relay['itl_routed_ms']['p50']:.1f} ms, direct "
                  f"{relay['itl_direct_ms']['p50']:.1f} ms; router delay per token p50 "
                  f"{relay['relay_delay_ms']['p50']:.2f} ms, p90 {relay['relay_delay_ms']['p90']:.2f} ms, "
                  f"p99 {relay['relay_delay_ms']['p99']:.2f} ms ({relay['tokens_matched']} tokens)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.2, help="Poisson arrivals per second")
    parser.add_argument("--relay-prompts", type=int, default=12, help="routed and as many direct (0: skip)")
    parser.add_argument("--relay-sweep", type=int, nargs="*", default=[], metavar="N",
                        help="relay cases with N routed (and N direct) streams each, before the main one")
    parser.add_argument("--deployments", nargs="+", default=list(DEPLOYMENTS), choices=list(DEPLOYMENTS))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--deployment-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment of the deployment's processes")
    parser.add_argument("--port", type=int, default=8731)
    parser.add_argument("--max-load", type=float, default=3.0, help="wait for the 1-minute load to drop to this")
    parser.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for --max-load at most")
    parser.add_argument("--out", default="benchmarks/results/serving_cpu.json")
    args = parser.parse_args()
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": "benchmarks/serving_cpu.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "deployments", "cases", "deployment_env")),
        "machine": f"this CPU machine ({machine_load()['cpus']} cores), shared with other sessions",
        "load_at_start": wait_for_quiet(args.max_load, args.max_wait), "deployments": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="serving_cpu_"))  # kept: a worker that died says why there
    for name in args.deployments:
        try:
            report["deployments"][name] = run_deployment(name, args, logs)
        except (RuntimeError, httpx.HTTPError) as exc:  # e.g. a worker killed by the OOM killer on a shared box
            report["failed"] = f"{name}: {exc!r} (logs in {logs})"
            break
        report["load_at_end"] = machine_load()
        Path(args.out).write_text(json.dumps(report, indent=1))  # what is done so far survives a later failure
    if "failed" in report:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"failed: {report['failed']}")
        return 1
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
