"""Choosing the P:D split and the pool size for a workload under SLOs.

At the workload's arrival rate, the smallest cluster whose SLO attainment (share of requests meeting every
SLO) reaches the target has the most goodput per worker: goodput cannot exceed the offered rate, so adding
workers past that point only divides it. The search:

  1. capacity estimates from the profile: prompts/s one P worker prefills at a full token budget, and
     requests/s one D worker decodes at the largest batch whose step time meets the TPOT SLO;
     they give a first total N and split;
  2. for a total N, hill-climb over the split P (the best split is where neither pool is the bottleneck,
     attainment is unimodal in P around it) from the estimate's share;
  3. grow N by doubling until some split meets the target, then bisect N down to the smallest that does.

Every (P, D) simulated is kept for the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.bench.metrics import SLOs
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import ClusterSpec, simulate
from pdserve.planner.workload import WorkloadSpec, make_workload


@dataclass(frozen=True)
class Candidate:
    num_prefill: int
    num_decode: int
    attainment: float
    goodput: float  # requests/s meeting every SLO
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    refused: int

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.num_workers


@dataclass(frozen=True)
class PlanResult:
    candidates: list[Candidate]  # every split simulated, by total then P
    recommended: Candidate | None  # None: no cluster up to max_workers meets the target
    target_attainment: float
    capacity_prefill: float  # requests/s per P worker (estimate)
    capacity_decode: float  # requests/s per D worker (estimate)


def capacity_estimates(profile: Profile, cluster: ClusterSpec, spec: WorkloadSpec, slos: SLOs) -> tuple[float, float]:
    """(requests/s per P worker, requests/s per D worker) from the fitted models alone."""
    mean_in = spec.input_len.mean * (1.0 - spec.prefix_ratio)
    per_batch = max(1, cluster.max_num_batched_tokens // max(1, int(mean_in)))
    cap_p = per_batch / profile.prefill_time([int(mean_in)] * per_batch)
    mean_out = spec.output_len.mean
    ctx = spec.input_len.mean + mean_out / 2
    batch_by_kv = max(1, int(cluster.num_blocks * cluster.block_size // (spec.input_len.mean + mean_out)))
    batch = min(cluster.max_num_seqs, batch_by_kv)
    if slos.tpot_ms is not None:
        while batch > 1 and profile.decode_time(batch, int(batch * ctx)) * 1000.0 > slos.tpot_ms:
            batch -= 1
    cap_d = batch / (profile.decode_time(batch, int(batch * ctx)) * max(1.0, mean_out - 1))
    return cap_p, cap_d


class Planner:
    def __init__(self, profile: Profile, cluster: ClusterSpec, spec: WorkloadSpec, slos: SLOs,
                 target_attainment: float = 0.9, max_workers: int = 512) -> None:
        if not 0 < target_attainment <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {target_attainment}")
        if not slos.is_set():
            raise ValueError("planning needs at least one SLO (ttft, tpot or e2el)")
        self.profile, self.cluster, self.slos = profile, cluster, slos
        self.workload = make_workload(spec)
        self.target, self.max_workers = target_attainment, max_workers
        self.cap_p, self.cap_d = capacity_estimates(profile, cluster, spec, slos)
        self.rate = spec.request_rate
        self.seen: dict[tuple[int, int], Candidate] = {}

    def evaluate(self, num_prefill: int, num_decode: int) -> Candidate:
        key = (num_prefill, num_decode)
        if key not in self.seen:
            result = simulate(self.profile, replace(self.cluster, num_prefill=num_prefill, num_decode=num_decode),
                              self.workload)
            self.seen[key] = Candidate(
                num_prefill, num_decode, result.attainment(self.slos), result.goodput(self.slos),
                result.percentile_ms("ttft", 50), result.percentile_ms("ttft", 90),
                result.percentile_ms("tpot", 50), result.percentile_ms("tpot", 90), int(result.refused.sum()))
        return self.seen[key]

    def _score(self, c: Candidate) -> tuple[float, float]:
        return (c.attainment, c.goodput)

    def best_split(self, total: int) -> Candidate:
        """Hill-climb over P for a fixed total, from the capacity estimates' share."""
        share = (self.rate / self.cap_p) / (self.rate / self.cap_p + self.rate / self.cap_d)
        p = min(total - 1, max(1, round(total * share)))
        best = self.evaluate(p, total - p)
        for step in (1, -1):
            q = p + step
            while 1 <= q <= total - 1:
                c = self.evaluate(q, total - q)
                if self._score(c) <= self._score(best):
                    break
                best, q = c, q + step
            if best.num_prefill != p:
                break  # improved in this direction: the other side is worse
        return best

    def first_total(self) -> int:
        need = self.rate / self.cap_p + self.rate / self.cap_d
        return max(2, min(self.max_workers, math.ceil(need)))

    def search(self) -> PlanResult:
        def meets(c: Candidate) -> bool:
            return c.attainment >= self.target

        lo, hi = 1, self.first_total()
        best_hi = self.best_split(hi)
        while not meets(best_hi) and hi < self.max_workers:  # grow until feasible
            lo, hi = hi, min(self.max_workers, hi * 2)
            best_hi = self.best_split(hi)
        if not meets(best_hi):
            return self._result(None)
        while hi - lo > 1:  # smallest feasible total
            mid = (lo + hi) // 2
            c = self.best_split(mid) if mid >= 2 else None
            if c is not None and meets(c):
                hi, best_hi = mid, c
            else:
                lo = mid
        if hi + 1 <= self.max_workers:
            self.best_split(hi + 1)  # one size up, for the table
        return self._result(best_hi)

    def _result(self, recommended: Candidate | None) -> PlanResult:
        ordered = sorted(self.seen.values(), key=lambda c: (c.num_workers, c.num_prefill))
        return PlanResult(ordered, recommended, self.target, self.cap_p, self.cap_d)


def format_plan(result: PlanResult, slos: SLOs) -> str:
    header = (f"{'P':>4} {'D':>4} {'total':>5} {'attain':>7} {'goodput':>8} {'gp/worker':>9} "
              f"{'TTFT p50':>9} {'p90':>8} {'TPOT p50':>9} {'p90':>7} {'refused':>7}")
    lines = [(f"SLOs {slos.to_dict()} ms; target attainment {result.target_attainment:.0%}; capacity estimates "
             f"{result.capacity_prefill:.2f} req/s per P, {result.capacity_decode:.2f} req/s per D"), header]
    for c in result.candidates:
        mark = " <= recommended" if c == result.recommended else ""
        lines.append(f"{c.num_prefill:>4} {c.num_decode:>4} {c.num_workers:>5} {c.attainment:>7.1%} "
                     f"{c.goodput:>8.2f} {c.goodput_per_worker:>9.3f} {c.ttft_p50_ms:>9.1f} {c.ttft_p90_ms:>8.1f} "
                     f"{c.tpot_p50_ms:>9.2f} {c.tpot_p90_ms:>7.2f} {c.refused:>7}{mark}")
    if result.recommended is None:
        lines.append("no split up to the worker limit meets the target: relax the SLOs or raise --max-workers")
    else:
        r = result.recommended
        lines.append(f"recommended: {r.num_prefill} prefill + {r.num_decode} decode workers "
                     f"({r.goodput_per_worker:.3f} good req/s per worker, {r.attainment:.1%} within SLOs)")
    return "\n".join(lines)
