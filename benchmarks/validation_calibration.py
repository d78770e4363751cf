"""What plan_validation.py's `calibrated` simulation adds to the profile, measured on the running deployment
(router + 1 P + 1 D) with requests unlike the workloads', before the workloads run:

  single requests, one at a time (nothing else runs):
    prefill_slowdown_alone   P's forward seconds (its /metrics) over the profile's time for the same prompts:
                             the served forward runs beside P's own event loop (HTTP, KV frames) on P's core,
                             and the machine's speed may have drifted since the profile ran
    router_overhead_s        TTFT minus P's forward seconds, per request: router, HTTP hops, KV hand-off
    decode_overhead_s        TPOT minus the simulated TPOT, per step: scheduling, sampling, streaming
  8 requests at once:
    decode_overhead_per_seq_s  what TPOT at batch 8 adds per sequence beyond that
  side by side (D decoding 4 requests while P prefills 8 prompts one after another):
    decode_slowdown_beside_prefill, prefill_slowdown_beside_decode   how much slower each worker's model time
                             is while the other works (P and D share the host's caches and memory bandwidth),
                             from the workers' counters: measured busy = alone part + k × beside part, the two
                             parts being what the simulation of those requests (k = 1) spent apart and beside.

The simulator applies the two `beside` factors only while the other pool is busy (planner/simulator.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
from validation_cluster import delta, drive, model_name, worker_counters

from pdserve.bench.client import ApiTarget, RequestOutput
from pdserve.bench.datasets import LengthSpec, sample_random
from pdserve.bench.runner import LoadSpec, run_benchmark
from pdserve.bench.tokenizer import CountingTokenizer
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import ClusterSpec, SimResult, simulate
from pdserve.planner.workload import workload_from_lengths

CLUSTER_KEYS = ("router_overhead_s", "decode_overhead_s", "decode_overhead_per_seq_s",
                "decode_slowdown_beside_prefill", "prefill_slowdown_beside_decode")


def prompt_len(o: RequestOutput) -> int:
    """What P computed: the server's count (BOS included) when it sent usage, else the client's."""
    return o.server_prompt_tokens or o.prompt_len


def tpot(o: RequestOutput) -> float:
    return (o.latency - o.ttft) / (o.output_len - 1)


def simulate_sent(profile: Profile, cluster: ClusterSpec, outputs: list[RequestOutput]) -> SimResult:
    order = np.argsort([o.start_time for o in outputs])
    arrivals = np.array([outputs[i].start_time for i in order])
    workload = workload_from_lengths(arrivals - arrivals[0], [prompt_len(outputs[i]) for i in order],
                                     [outputs[i].output_len for i in order])
    return simulate(profile, cluster, workload)


def slowed(profile: Profile, prefill_slowdown: float) -> Profile:
    """The profile with the prefill model scaled by P's measured slowdown alone."""
    return replace(profile, prefill=replace(profile.prefill, coef=tuple(c * prefill_slowdown
                                                                        for c in profile.prefill.coef)))


def calibrate(profile: Profile, cluster: ClusterSpec, url: str, tokenizer: CountingTokenizer) -> dict[str, float]:
    """All the terms of the module docstring, in its order; each run simulated with the terms found before it."""
    convs = sample_random(8, LengthSpec(256, 0.5), LengthSpec(32), tokenizer, seed=7)
    before = worker_counters(url)
    outputs, _ = drive(url, convs, rate=float("inf"), burstiness=1.0, max_concurrency=1)
    forward_s = delta(before, worker_counters(url), "pdserve_prefill_forward_seconds")
    ideal = simulate_sent(profile, cluster, [replace(o, start_time=10.0 * i) for i, o in enumerate(outputs)])
    # per request, not per P iteration: the hops delay this request's first token, not P's queue
    single = {"prefill_slowdown_alone": forward_s / ideal.prefill_busy_s,
              "router_overhead_s": max(0.0, (sum(o.ttft for o in outputs) - forward_s) / len(outputs)),
              "decode_overhead_s": max(0.0, float(np.median([tpot(o) for o in outputs]) - np.median(ideal.tpot)))}
    profile = slowed(profile, single["prefill_slowdown_alone"])
    cluster = replace(cluster, **{k: v for k, v in single.items() if k in CLUSTER_KEYS})
    batch = sample_random(8, LengthSpec(64), LengthSpec(48), tokenizer, seed=8)
    outputs, _ = drive(url, batch, rate=float("inf"), burstiness=1.0)
    sim = simulate_sent(profile, cluster, outputs)
    extra = float(np.median([tpot(o) for o in outputs]) - np.median(sim.tpot))
    single["decode_overhead_per_seq_s"] = max(0.0, extra / len(batch))
    cluster = replace(cluster, decode_overhead_per_seq_s=single["decode_overhead_per_seq_s"])
    return single | side_by_side(profile, cluster, url, tokenizer)


def side_by_side(profile: Profile, cluster: ClusterSpec, url: str, tokenizer: CountingTokenizer) -> dict[str, float]:
    """The two `beside` slowdowns, with what they were derived from."""
    decoding = sample_random(4, LengthSpec(64), LengthSpec(96), tokenizer, seed=9)
    prefilling = sample_random(8, LengthSpec(192, 0.5), LengthSpec(2), tokenizer, seed=10)
    target = ApiTarget(url, "/v1/completions", model=model_name(url), ignore_eos=True)

    async def both() -> list[RequestOutput]:
        start = time.perf_counter()

        async def later() -> list[RequestOutput]:
            await asyncio.sleep(1.0)  # D is decoding by then
            offset = time.perf_counter() - start
            result = await run_benchmark(prefilling, target, LoadSpec(float("inf"), 1.0, 1, seed=1), progress=False)
            return [replace(o, start_time=o.start_time + offset) for o in result.outputs]

        first, second = await asyncio.gather(
            run_benchmark(decoding, target, LoadSpec(float("inf"), seed=1), progress=False), later())
        return first.outputs + second

    before = worker_counters(url)
    outputs = asyncio.run(both())
    after = worker_counters(url)
    sim = simulate_sent(profile, cluster, outputs)  # both slowdowns at 1: the split of busy time
    measured_p = delta(before, after, "pdserve_prefill_forward_seconds")
    measured_d = delta(before, after, "pdserve_decode_step_seconds")
    return {"prefill_slowdown_beside_decode": _beside(measured_p, sim.prefill_busy_s, sim.prefill_busy_beside_decode_s),
            "decode_slowdown_beside_prefill": _beside(measured_d, sim.decode_busy_s, sim.decode_busy_beside_prefill_s),
            "side_by_side_measured_busy_s": {"prefill": measured_p, "decode": measured_d},
            "side_by_side_sim_busy_s": {"prefill": sim.prefill_busy_s, "decode": sim.decode_busy_s},
            "side_by_side_sim_beside_s": {"prefill": sim.prefill_busy_beside_decode_s,
                                          "decode": sim.decode_busy_beside_prefill_s}}


def _beside(measured: float, simulated: float, beside: float) -> float:
    """k in measured = (simulated - beside) + k · beside; 1 when nothing ran beside the other pool."""
    return (measured - (simulated - beside)) / beside if beside > 0 else 1.0
