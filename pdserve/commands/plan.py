"""`pdserve plan`: from a profile (`pdserve profile`), a workload and SLOs, simulate router + P pool + D pool
and recommend the P:D split and pool size with the most goodput per worker (planner/plan.py); then say
how the choice was made and print the `pdserve serve` (and, for a GPU profile, `pdserve compose`) command that
deploys it (planner/deploy_command.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.planner.simulator import ClusterSpec
    from pdserve.planner.workload import WorkloadSpec


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("plan", help="choose prefill/decode pool sizes by simulation")
    p.add_argument("--profile", required=True, help="profile JSON written by `pdserve profile`")
    w = p.add_argument_group("workload")
    w.add_argument("--request-rate", type=float, required=True, help="arrivals per second")
    w.add_argument("--num-requests", type=int, default=5000, help="requests simulated per candidate")
    w.add_argument("--lengths-from", default=None, metavar="BENCH_RESULT.json",
                   help="draw (input, output) lengths from a `pdserve bench --save-result` file instead")
    w.add_argument("--input-len", type=int, default=1024, help="prompt length")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    w.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    w.add_argument("--length-dist", default="uniform", choices=["uniform", "normal"],
                   help="distribution of the lengths")
    w.add_argument("--prefix-ratio", type=float, default=0.0, help="share of each prompt that is a group prefix")
    w.add_argument("--num-prefix-groups", type=int, default=1, help="distinct shared prefixes")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    w.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    s = p.add_argument_group("objective")
    s.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:50"], metavar="KEY:MS",
                   help="SLOs in ms (default ttft:1000 tpot:50)")
    s.add_argument("--target-attainment", type=float, default=0.9,
                   help="the gate: the share of simulated requests within every SLO a split must reach to qualify")
    s.add_argument("--max-workers", type=int, default=512, help="largest P + D considered")
    s.add_argument("--num-prefill", type=int, default=None, help="simulate this split only (with --num-decode)")
    s.add_argument("--num-decode", type=int, default=None, help="simulate this split only (with --num-prefill)")
    c = p.add_argument_group("cluster (as the workers are started)")
    c.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one prefill iteration at most")
    c.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch at most")
    c.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per decode worker")
    c.add_argument("--kv-bandwidth-gbps", type=float, default=10.0, help="P -> D transfer, GB/s")
    c.add_argument("--kv-latency-ms", type=float, default=0.5, help="P → D transfer latency per request")
    c.add_argument("--router-overhead-ms", type=float, default=0.0, help="router time per request")
    c.add_argument("--prefill-overhead-ms", type=float, default=0.0, help="per prefill iteration")
    c.add_argument("--decode-overhead-ms", type=float, default=0.0, help="per decode step")
    c.add_argument("--decode-overhead-per-seq-ms", type=float, default=0.0, help="per sequence in a decode step")
    c.add_argument("--decode-slowdown-beside-prefill", type=float, default=1.0,
                   help="decode step time × this while P works on the same host (CPU: shared caches and memory "
                        "bandwidth; benchmarks/plan_validation.py measures it); 1: separate devices")
    c.add_argument("--prefill-slowdown-beside-decode", type=float, default=1.0,
                   help="prefill time × this while D works on the same host")
    p.add_argument("--output", default=None, help="write the candidates and the recommendation as JSON")
    k = p.add_argument_group("Kubernetes (deploy/k8s)")
    k.add_argument("--kustomize-replicas", default=None, metavar="FILE",
                   help="write the recommended pool sizes as a kustomize patch of the pdserve-prefill and "
                        "pdserve-decode Deployments, e.g. deploy/k8s/overlays/cpu/replicas.yaml")
    k.add_argument("--hpa-max-factor", type=float, default=None,
                   help="with --kustomize-replicas: also patch the autoscalers, minReplicas = the plan's count and "
                        "maxReplicas = that x this factor (leave out for an overlay without autoscaling)")
    p.set_defaults(func=run)


def cluster_from_args(args: argparse.Namespace, block_size: int, num_prefill: int = 1,
                      num_decode: int = 1) -> ClusterSpec:
    from pdserve.planner.simulator import ClusterSpec

    return ClusterSpec(num_prefill, num_decode, args.max_num_batched_tokens, args.max_num_seqs, args.num_blocks,
                       block_size, args.kv_bandwidth_gbps * 1e9, args.kv_latency_ms / 1e3,
                       args.router_overhead_ms / 1e3, args.prefill_overhead_ms / 1e3, args.decode_overhead_ms / 1e3,
                       args.decode_overhead_per_seq_ms / 1e3,
                       decode_slowdown_beside_prefill=args.decode_slowdown_beside_prefill,
                       prefill_slowdown_beside_decode=args.prefill_slowdown_beside_decode)


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    from pdserve.bench.datasets import LengthSpec
    from pdserve.planner.workload import WorkloadSpec

    if args.lengths_from:
        return WorkloadSpec.from_bench_result(args.lengths_from, args.request_rate, args.num_requests,
                                              prefix_ratio=args.prefix_ratio, num_prefix_groups=args.num_prefix_groups,
                                              burstiness=args.burstiness, seed=args.seed)
    return WorkloadSpec(args.request_rate, args.num_requests,
                        LengthSpec(args.input_len, args.range_ratio, args.length_dist),
                        LengthSpec(args.output_len, args.range_ratio, args.length_dist),
                        args.prefix_ratio, args.num_prefix_groups, args.burstiness, args.seed)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from pdserve.bench.metrics import SLOs
    from pdserve.engine.weights import DEFAULT_MODEL, KNOWN_MODELS
    from pdserve.planner.deploy_command import deploy_lines, gate_explanation
    from pdserve.planner.plan import Planner, PlanResult, format_plan
    from pdserve.planner.profile import Profile

    try:
        profile = Profile.load(args.profile)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pdserve plan: --profile {args.profile}: {exc}") from None
    slos = SLOs.parse(args.goodput)
    planner = Planner(profile, cluster_from_args(args, profile.block_size), workload_from_args(args), slos,
                      args.target_attainment, args.max_workers)
    start = time.perf_counter()
    if args.num_prefill is not None or args.num_decode is not None:
        if args.num_prefill is None or args.num_decode is None:
            print("--num-prefill and --num-decode go together", file=sys.stderr)
            return 2
        only = planner.evaluate(args.num_prefill, args.num_decode)
        result = PlanResult([only], None, planner.target, planner.cap_p, planner.cap_d)
    else:
        result = planner.search()
    elapsed = time.perf_counter() - start
    print(format_plan(result, slos))
    print(f"{len(result.candidates)} clusters simulated ({args.num_requests} requests each) in {elapsed:.1f} s")
    print(gate_explanation(planner.target, slos))
    choice = result.recommended or (result.candidates[0] if args.num_prefill is not None else None)
    if choice is not None:
        print("\n".join(deploy_lines(choice, planner.cluster, profile.model, profile.device,
                                     KNOWN_MODELS[DEFAULT_MODEL].preset)))
    if args.output:
        payload = {"profile": args.profile, "workload": vars(args) | {"func": None}, "slos_ms": slos.to_dict(),
                   "candidates": [asdict(c) for c in result.candidates],
                   "recommended": asdict(result.recommended) if result.recommended else None}
        with open(args.output, "w") as f:
            json.dump(payload, f, indent=1, default=str)
    if args.kustomize_replicas:
        chosen = result.recommended or (result.candidates[0] if args.num_prefill is not None else None)
        if chosen is None:
            print(f"no plan met the objective: {args.kustomize_replicas} not written", file=sys.stderr)
        else:
            write_replicas(args, chosen.num_prefill, chosen.num_decode)
    return 0 if result.recommended is not None or args.num_prefill is not None else 1


def write_replicas(args: argparse.Namespace, num_prefill: int, num_decode: int) -> None:
    from pathlib import Path

    from pdserve.planner.replicas import ReplicaPlan, kustomize_patch

    plan = ReplicaPlan(num_prefill, num_decode, args.hpa_max_factor)
    command = "pdserve " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["plan"] else "pdserve plan"
    comment = (f"Pool sizes written by `pdserve plan` ({time.strftime('%Y-%m-%d')}): {num_prefill} prefill + "
               f"{num_decode} decode workers for {args.request_rate:g} req/s.\n{command}")
    Path(args.kustomize_replicas).write_text(kustomize_patch(plan, comment))
    print(f"wrote {args.kustomize_replicas}: {num_prefill} P + {num_decode} D")
