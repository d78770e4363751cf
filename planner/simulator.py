"""Discrete-event simulation of a router with a prefill pool and a decode pool (see sim_workers.py for the
workers' policies). Events, in a heap by time:

  ARRIVAL  the router picks D (least KV usage, then fewest running: router/policies.py LeastKV) and reserves
           prompt + 1 blocks there (no D with room: the request is refused, as the router answers 503), then
           queues the prompt on P (fewest queued + prefilling: LeastLoaded)
  P_DONE   a prefill iteration ended; finished prompts produce their first token and push their KV to D:
           KV_DONE after latency + bytes / bandwidth
  KV_DONE  D emits the first token (TTFT) and queues the request for a running slot
  D_DONE   a decode step ended: every running request has one more token; finished ones leave

TTFT = KV_DONE - arrival; TPOT = (finish - first token) / (output_len - 1), as `pdserve bench` measures them.

Workers that share one host's caches and memory bandwidth (P and D processes on one CPU host) slow each other
down: a decode step is priced × (1 + (decode_slowdown_beside_prefill - 1) · busy fraction of the P pool) when it
starts, and a prefill iteration × (1 + (prefill_slowdown_beside_decode - 1) · busy fraction of the D pool). A
decode run of several steps is cut at the step in progress when the P pool's busy count changes, so its later
steps are priced anew. Both factors are 1 for workers that share nothing (their own GPUs).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from pdserve.bench.metrics import SLOs
from pdserve.planner.profile import Profile
from pdserve.planner.sim_workers import DecodeWorker, PrefillWorker
from pdserve.planner.workload import Workload

ARRIVAL, P_DONE, KV_DONE, D_DONE = 0, 1, 2, 3


@dataclass(frozen=True)
class ClusterSpec:
    """A router, num_prefill P workers and num_decode D workers, with the serving limits of the real nodes."""

    num_prefill: int
    num_decode: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    num_blocks: int = 2048  # per decode worker
    block_size: int = 16
    kv_bandwidth: float = 10e9  # bytes/s, P -> D
    kv_latency_s: float = 0.0005  # per transfer
    router_overhead_s: float = 0.0  # per request, before it reaches P (tokenise, HTTP hops)
    prefill_overhead_s: float = 0.0  # per P iteration, on top of the model (scheduling, sampling)
    decode_overhead_s: float = 0.0  # per D step, on top of the model
    decode_overhead_per_seq_s: float = 0.0  # per sequence in a D step (sampling, detokenising, streaming)
    heartbeat_interval_s: float = 1.0  # workers report load this often; the router adds its own in-flight counts
    # model time × this while the other pool works on the same host (see the module docstring); 1: none
    decode_slowdown_beside_prefill: float = 1.0
    prefill_slowdown_beside_decode: float = 1.0

    def __post_init__(self) -> None:
        if self.num_prefill <= 0 or self.num_decode <= 0:
            raise ValueError(f"a cluster needs P and D workers, got P={self.num_prefill} D={self.num_decode}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0 or self.num_blocks <= 1:
            raise ValueError(f"bad limits: max_num_batched_tokens={self.max_num_batched_tokens}, "
                             f"max_num_seqs={self.max_num_seqs}, num_blocks={self.num_blocks}")
        if self.decode_slowdown_beside_prefill <= 0 or self.prefill_slowdown_beside_decode <= 0:
            raise ValueError(f"slowdowns must be positive, got decode {self.decode_slowdown_beside_prefill}, "
                             f"prefill {self.prefill_slowdown_beside_decode}")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode


@dataclass(frozen=True)
class SimResult:
    """Per-request times in s (NaN for refused requests) and counters."""

    arrival: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    refused: np.ndarray  # bool
    num_preemptions: int
    # model time the workers spent, summed over workers: what a real run's /metrics (forward_seconds,
    # step_seconds, steps) can be checked against, the model apart from the queueing
    prefill_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    num_decode_steps: int = 0
    # the part of that busy time spent beside the other pool (weighted by its busy fraction): with the
    # slowdowns at 1, what a side-by-side measurement divides out to find them
    prefill_busy_beside_decode_s: float = 0.0
    decode_busy_beside_prefill_s: float = 0.0

    @property
    def duration(self) -> float:
        finish = self.arrival + self.e2e
        return float(np.nanmax(finish) - self.arrival.min()) if (~self.refused).any() else 0.0

    def good(self, slos: SLOs) -> np.ndarray:
        ok = ~self.refused
        for slo, values in ((slos.ttft_ms, self.ttft), (slos.tpot_ms, self.tpot), (slos.e2el_ms, self.e2e)):
            if slo is not None:
                ok &= np.nan_to_num(values, nan=np.inf) * 1000.0 <= slo
        return ok

    def attainment(self, slos: SLOs) -> float:
        return float(self.good(slos).mean())

    def goodput(self, slos: SLOs) -> float:
        return float(self.good(slos).sum()) / self.duration if self.duration > 0 else 0.0

    def percentile_ms(self, metric: str, p: float) -> float:
        values = {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.e2e}[metric]
        values = values[~self.refused]
        if metric == "tpot":
            values = values[values > 0]
        return float(np.percentile(values, p) * 1000.0) if values.size else float("nan")


class Simulation:
    def __init__(self, profile: Profile, cluster: ClusterSpec, workload: Workload) -> None:
        self.profile, self.cluster, self.w = profile, cluster, workload
        self.inp, self.out = workload.input_len.tolist(), workload.output_len.tolist()
        self.prefix, self.group = workload.prefix_len.tolist(), workload.group.tolist()
        self.prefill = [PrefillWorker(cluster.max_num_batched_tokens, cluster.block_size)
                        for _ in range(cluster.num_prefill)]
        self.decode = [DecodeWorker(cluster.num_blocks, cluster.block_size, cluster.max_num_seqs)
                       for _ in range(cluster.num_decode)]
        # the router's view: last heartbeat + what it sent since (router/registry.py Worker.kv_usage, inflight)
        self.p_reported, self.p_inflight = np.zeros(cluster.num_prefill), np.zeros(cluster.num_prefill)
        self.d_used, self.d_pending = np.zeros(cluster.num_decode), np.zeros(cluster.num_decode)
        self.d_running, self.d_inflight = np.zeros(cluster.num_decode), np.zeros(cluster.num_decode)
        n = len(workload)
        self.first, self.finish = np.full(n, np.nan), np.full(n, np.nan)
        self.refused: np.ndarray = np.zeros(n, dtype=bool)
        self.d_of: np.ndarray = np.zeros(n, dtype=np.int64)
        a, pad, b, c, multi = profile.decode_coef()
        self.decode_coef = (a, pad, b + cluster.decode_overhead_per_seq_s, c, multi)
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.prefill_busy_s = self.decode_busy_s = 0.0
        self.prefill_beside_s = self.decode_beside_s = 0.0
        self.num_decode_steps = 0
        self.p_busy = self.d_busy = 0  # workers of each pool in the middle of an iteration / a run

    def push(self, t: float, kind: int, index: int, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, index, version))

    def run(self) -> SimResult:
        arrivals = (self.w.arrival + self.cluster.router_overhead_s).tolist()
        handlers = {P_DONE: self._p_done, KV_DONE: self._kv_done}
        next_arrival, next_beat = 0, self.cluster.heartbeat_interval_s
        while next_arrival < len(arrivals) or self.events:
            t_event = self.events[0][0] if self.events else np.inf
            t_arrival = arrivals[next_arrival] if next_arrival < len(arrivals) else np.inf
            if next_beat <= min(t_event, t_arrival):
                self._heartbeat(next_beat)
                next_beat += self.cluster.heartbeat_interval_s
            elif t_arrival <= t_event:
                self._arrive(t_arrival, next_arrival)
                next_arrival += 1
            else:
                t, _, kind, index, version = heapq.heappop(self.events)
                if kind == D_DONE:
                    self._d_done(t, index, version)
                else:
                    handlers[kind](t, index)
        return self._result()

    def _heartbeat(self, t: float) -> None:
        for d, worker in enumerate(self.decode):
            self._sync(t, d)
            self.d_used[d] = worker.total - worker.free
            self.d_running[d] = len(worker.running)
        self.d_pending[:] = 0
        self.p_reported[:] = [p.load for p in self.prefill]

    def _sync(self, t: float, d: int) -> None:
        """Bring a decode worker's block count to time t inside a multi-step run."""
        worker = self.decode[d]
        if worker.busy and worker.run_len > worker.run_taken:
            overhead = self.cluster.decode_overhead_s
            worker.sync_to(worker.steps_done_by(t - worker.run_start_t, self.decode_coef, overhead))

    def _result(self) -> SimResult:
        out = self.w.output_len
        tpot = np.where(out > 1, (self.finish - self.first) / np.maximum(out - 1, 1), 0.0)
        return SimResult(self.w.arrival, self.first - self.w.arrival, np.where(self.refused, np.nan, tpot),
                         self.finish - self.w.arrival, self.refused, sum(d.num_preemptions for d in self.decode),
                         self.prefill_busy_s, self.decode_busy_s, self.num_decode_steps,
                         self.prefill_beside_s, self.decode_beside_s)

    def _decode_order(self) -> np.ndarray:
        """LeastKV: lowest KV usage (reported + reserved since), then fewest running (reported + in flight)."""
        usage = (self.d_used + self.d_pending) / self.cluster.num_blocks
        order: np.ndarray = np.lexsort((self.d_running + self.d_inflight, usage))
        return order

    def _arrive(self, t: float, rid: int) -> None:
        d = self._reserve(t, rid)
        if d < 0:
            self.refused[rid] = True  # every D answered 503: so does the router
            return
        self.d_of[rid] = d
        p = int(np.argmin(self.p_reported + self.p_inflight))  # LeastLoaded
        self.prefill[p].queue.append(rid)
        self.p_inflight[p] += 1
        if not self.prefill[p].busy:
            self._p_start(t, p)

    def _reserve(self, t: float, rid: int) -> int:
        """Ask the decode workers in the policy's order; the first with room reserves prompt + 1 blocks."""
        order = self._decode_order() if self.cluster.num_decode > 1 else (0,)
        for d in order:
            worker = self.decode[d]
            self._sync(t, d)
            if worker.reserve(self.inp[rid]):
                self.d_pending[d] += worker.admission.reservation_blocks(self.inp[rid])
                self.d_inflight[d] += 1
                if worker.busy and worker.run_len > worker.run_taken and not worker.rest_fits():
                    self._cut(d, worker.run_taken)  # step by step, a later step would preempt: let it
                return int(d)
        return -1

    def _p_start(self, t: float, p: int) -> None:
        worker = self.prefill[p]
        plan = worker.schedule(self.inp, self.prefix, self.group)
        self._set_p_busy(t, worker, bool(plan))
        if not plan:
            return
        beside = self.d_busy / self.cluster.num_decode
        scale = 1.0 + (self.cluster.prefill_slowdown_beside_decode - 1.0) * beside
        dt = worker.iteration_time(plan, self.profile, self.cluster.prefill_overhead_s, scale)
        self.prefill_busy_s += dt
        self.prefill_beside_s += dt * beside
        self.push(t + dt, P_DONE, p)

    def _set_p_busy(self, t: float, worker: PrefillWorker, busy: bool) -> None:
        """A change in the P pool's busy count reprices the decode runs in progress from their next step."""
        if worker.busy == busy:
            return
        worker.busy = busy
        self.p_busy += 1 if busy else -1
        if self.cluster.decode_slowdown_beside_prefill != 1.0:
            for d, decode in enumerate(self.decode):
                if decode.busy and decode.run_len > 1:
                    self._cut_run(t, d)

    def _decode_scale(self) -> tuple[float, float]:
        """(scale of a decode step starting now, the P pool's busy fraction)."""
        beside = self.p_busy / self.cluster.num_prefill
        return 1.0 + (self.cluster.decode_slowdown_beside_prefill - 1.0) * beside, beside

    def _p_done(self, t: float, p: int) -> None:
        worker = self.prefill[p]
        per_token = self.profile.kv_bytes_per_token / self.cluster.kv_bandwidth
        for rid in worker.finish_iteration(self.inp, self.group, self.prefix):
            self.p_inflight[p] -= 1
            self.push(t + self.cluster.kv_latency_s + self.inp[rid] * per_token, KV_DONE, rid)
        self._p_start(t, p)

    def _kv_done(self, t: float, rid: int) -> None:
        self.first[rid] = t
        d = int(self.d_of[rid])
        worker = self.decode[d]
        if self.out[rid] <= 1:
            self.finish[rid] = t
            self.d_inflight[d] -= 1
            worker.release_reservation(self.inp[rid])
        else:
            worker.kv_arrived(rid, self.inp[rid], self.out[rid])
            if not worker.busy:
                self._d_start(t, d)
            elif worker.run_len > 1 and worker.admission.has_slot(len(worker.running)):
                self._cut_run(t, d)  # it can join at the next step boundary

    def _d_start(self, t: float, d: int) -> None:
        worker = self.decode[d]
        if not worker.has_work:
            self._set_d_busy(worker, False)
            return
        worker.start_step()
        if not worker.running:  # everything is preempted and waits for blocks: nothing can run
            self._set_d_busy(worker, False)
            return
        self._set_d_busy(worker, True)
        worker.run_start_t = t
        worker.run_scale, worker.run_beside = self._decode_scale()
        dt = worker.run_time(worker.run_len, self.decode_coef, self.profile, self.cluster.decode_overhead_s)
        self.push(t + dt, D_DONE, d, worker.version)

    def _cut_run(self, t: float, d: int) -> None:
        """A request arrived during a multi-step run: end the run with the step now in progress."""
        worker = self.decode[d]
        m = worker.steps_done_by(t - worker.run_start_t, self.decode_coef, self.cluster.decode_overhead_s)
        if m < worker.run_len:
            self._cut(d, m)

    def _cut(self, d: int, m: int) -> None:
        worker = self.decode[d]
        worker.sync_to(m)
        worker.cut_run(m)
        end = worker.run_start_t + worker.run_time(worker.run_len, self.decode_coef, self.profile,
                                                   self.cluster.decode_overhead_s)
        self.push(end, D_DONE, d, worker.version)

    def _d_done(self, t: float, d: int, version: int) -> None:
        worker = self.decode[d]
        if version != worker.version:
            return  # the run was cut short; its new end event follows
        self.decode_busy_s += t - worker.run_start_t
        self.decode_beside_s += (t - worker.run_start_t) * worker.run_beside
        self.num_decode_steps += worker.run_len
        done = worker.finish_run()
        for rid in done:
            self.finish[rid] = t
        self.d_inflight[d] -= len(done)
        self._d_start(t, d)


    def _set_d_busy(self, worker: DecodeWorker, busy: bool) -> None:
        if worker.busy != busy:
            worker.busy = busy
            self.d_busy += 1 if busy else -1


def simulate(profile: Profile, cluster: ClusterSpec, workload: Workload) -> SimResult:
    return Simulation(profile, cluster, workload).run()
