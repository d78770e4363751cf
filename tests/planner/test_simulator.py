from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from pdserve.bench.datasets import LengthSpec
from pdserve.bench.metrics import SLOs
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import ClusterSpec, Simulation, simulate
from pdserve.planner.workload import WorkloadSpec, make_workload, workload_from_lengths


def _one(arrivals: list[float], ins: list[int], outs: list[int]):
    return workload_from_lengths(np.array(arrivals), ins, outs)


def test_single_request_times_follow_the_profile(gpu_like_profile: Profile) -> None:
    p = gpu_like_profile
    cluster = ClusterSpec(1, 1, kv_bandwidth=1e9, kv_latency_s=0.001, router_overhead_s=0.002)
    r = simulate(p, cluster, _one([0.0], [300], [5]))
    transfer = 0.001 + 300 * p.kv_bytes_per_token / 1e9
    assert r.ttft[0] == pytest.approx(0.002 + p.prefill_time([300]) + transfer)
    steps = [p.decode_time(1, 301 + j) for j in range(4)]  # tokens 2..5, context grows by one each step
    assert r.tpot[0] == pytest.approx(np.mean(steps))
    assert r.e2e[0] == pytest.approx(r.ttft[0] + sum(steps))


def test_long_prompt_is_chunked_under_the_token_budget(gpu_like_profile: Profile) -> None:
    p = gpu_like_profile
    r = simulate(p, ClusterSpec(1, 1, max_num_batched_tokens=512, kv_latency_s=0.0, kv_bandwidth=1e30),
                 _one([0.0], [1200], [2]))
    chunks = p.prefill_time([512], [0]) + p.prefill_time([512], [512]) + p.prefill_time([176], [1024])
    assert r.ttft[0] == pytest.approx(chunks)


def test_prompts_queued_during_an_iteration_share_the_next(gpu_like_profile: Profile) -> None:
    p = gpu_like_profile
    cluster = ClusterSpec(1, 1, kv_latency_s=0.0, kv_bandwidth=1e30)
    r = simulate(p, cluster, _one([0.0, 0.001, 0.001], [1000, 100, 200], [2, 3, 3]))
    first = p.prefill_time([1000])
    assert r.ttft[0] == pytest.approx(first)  # an idle worker starts on the first prompt at once
    assert r.arrival[1] + r.ttft[1] == pytest.approx(first + p.prefill_time([100, 200]))
    assert r.ttft[2] == pytest.approx(r.ttft[1])
    # their KV arrives in two events: the first starts a decode step alone, the second joins the next one
    assert r.tpot[1] == pytest.approx((p.decode_time(1, 101) + p.decode_time(2, 102 + 201)) / 2)


def test_a_decode_step_costs_the_padded_longest_context(cpu_like_profile: Profile) -> None:
    """A CPU step pads every row to the longest context: the 1,000-token prompt's row costs the 100-token one
    a step priced at batch 2 × 1,001+, not at Σctx."""
    p = cpu_like_profile
    cluster = ClusterSpec(1, 1, kv_latency_s=0.0, kv_bandwidth=1e30)
    r = simulate(p, cluster, _one([0.0, 0.001], [1000, 100], [12, 3]))
    # the long prompt's KV arrives first and runs alone until the short one's joins, then both run together
    joined_at = r.ttft[1] + r.arrival[1]
    alone = [p.decode_time(1, 1001 + j) for j in range(11)]
    done_alone = np.cumsum(alone) + r.ttft[0]
    k = int(np.searchsorted(done_alone, joined_at))  # the long one's step in progress when the short one joins
    both = [p.decode_time(2, 1002 + k + j + 101 + j, 1002 + k + j) for j in range(2)]
    assert r.tpot[1] == pytest.approx((done_alone[k] - joined_at + both[0] + both[1]) / 2)
    assert both[0] > p.decode_time(2, 1002 + k + 101)  # more than a uniform batch of the same Σctx


def test_max_num_seqs_makes_requests_wait_for_a_slot(gpu_like_profile: Profile) -> None:
    cluster = ClusterSpec(1, 1, max_num_seqs=1, kv_latency_s=0.0, kv_bandwidth=1e30)
    r = simulate(gpu_like_profile, cluster, _one([0.0, 0.0001], [64, 64], [10, 10]))
    finish = r.arrival + r.e2e
    assert r.ttft[1] < r.e2e[0]  # the first token frame goes out when the KV arrives, not when a slot frees
    assert finish[1] == pytest.approx(finish[0] + 9 * gpu_like_profile.decode_time(1, 70), rel=0.05)


def test_kv_capacity_refuses_and_preempts_without_leaking(gpu_like_profile: Profile) -> None:
    refuse = simulate(gpu_like_profile, ClusterSpec(1, 1, num_blocks=10), _one([0.0, 0.0], [100, 100], [4, 4]))
    assert refuse.refused.tolist() == [False, True]  # 7 blocks + 1 watermark leave no room for the second
    cluster = ClusterSpec(1, 1, num_blocks=40, max_num_seqs=8)
    w = _one([0.0] * 4, [60] * 4, [200] * 4)  # 4 x 5 blocks reserved, then each grows to 17 blocks
    sim = Simulation(gpu_like_profile, cluster, w)
    r = sim.run()
    assert r.num_preemptions > 0 and not r.refused.any()
    assert np.isfinite(r.e2e).all() and (r.tpot > 0).all()
    d = sim.decode[0]
    assert d.free == d.total and not d.running and sum(d.due) == 0 and d.sum_ctx == 0


def test_prefix_sharing_cuts_prefill(gpu_like_profile: Profile) -> None:
    base = WorkloadSpec(2.0, 200, LengthSpec(2048), LengthSpec(8), seed=1)
    shared = WorkloadSpec(2.0, 200, LengthSpec(2048), LengthSpec(8), prefix_ratio=0.75, num_prefix_groups=2, seed=1)
    cluster = ClusterSpec(2, 2)
    plain = simulate(gpu_like_profile, cluster, make_workload(base))
    cached = simulate(gpu_like_profile, cluster, make_workload(shared))
    assert cached.percentile_ms("ttft", 50) < 0.6 * plain.percentile_ms("ttft", 50)


def test_router_spreads_over_decode_workers(gpu_like_profile: Profile) -> None:
    sim = Simulation(gpu_like_profile, ClusterSpec(1, 2), _one([0.0, 0.0, 0.0, 0.0], [100] * 4, [3] * 4))
    sim.run()
    assert sorted(sim.d_of.tolist()) == [0, 0, 1, 1]
    assert all(d.free == d.total for d in sim.decode)


def test_slo_accounting(gpu_like_profile: Profile) -> None:
    r = simulate(gpu_like_profile, ClusterSpec(1, 1), _one([0.0, 5.0], [100, 4000], [20, 20]))
    slos = SLOs(ttft_ms=50, tpot_ms=50)
    assert r.good(slos).tolist() == [True, False]  # 4,000 tokens take ~92 ms to prefill
    assert r.attainment(slos) == 0.5 and r.goodput(slos) == pytest.approx(1 / r.duration)


def test_two_hundred_workers_twenty_thousand_requests(gpu_like_profile: Profile) -> None:
    """The planner's scale: report the time (not asserted: the test machine is shared)."""
    w = make_workload(WorkloadSpec(400.0, 20_000, LengthSpec(1024, 0.5), LengthSpec(256, 0.5)))
    start = time.perf_counter()
    r = simulate(gpu_like_profile, ClusterSpec(60, 140, num_blocks=8000, max_num_seqs=128), w)
    elapsed = time.perf_counter() - start
    print(f"\n200 workers, 20,000 requests simulated in {elapsed:.2f} s")
    assert np.isfinite(r.e2e).all() and r.attainment(SLOs(ttft_ms=500, tpot_ms=50)) > 0.95


@pytest.mark.parametrize("profile_name", ["gpu_like_profile", "cpu_like_profile"])
def test_multi_step_runs_match_step_by_step(profile_name: str, request: pytest.FixtureRequest,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps are simulated in runs (one event until something joins or leaves); the results must be
    those of simulating every step, preemptions and refusals included (with the padded CPU step too)."""
    from pdserve.planner import sim_workers

    profile: Profile = request.getfixturevalue(profile_name)
    w = make_workload(WorkloadSpec(60.0, 1500, LengthSpec(1024, 0.9), LengthSpec(256, 0.9), prefix_ratio=0.3,
                                   num_prefix_groups=5, burstiness=0.3))
    cluster = ClusterSpec(3, 4, num_blocks=600, max_num_seqs=32)
    runs = simulate(profile, cluster, w)

    def one_step(self: sim_workers.DecodeWorker, joined: bool) -> int:
        self.run_taken = 1
        return 1

    monkeypatch.setattr(sim_workers.DecodeWorker, "_plan_run", one_step)
    steps = simulate(profile, cluster, w)
    assert runs.num_preemptions == steps.num_preemptions > 0
    assert (runs.refused == steps.refused).all() and runs.refused.any()
    np.testing.assert_allclose(runs.e2e, steps.e2e, rtol=1e-9)
    np.testing.assert_allclose(runs.ttft, steps.ttft, rtol=1e-9)


def test_a_step_of_two_rows_pays_the_multi_row_term() -> None:
    """CPU matmuls of one row are GEMVs: a lone request's steps skip the multi_row term, two requests' pay it."""
    from pdserve.planner.profile import DECODE_TERMS, PREFILL_TERMS, LinearFit

    p = Profile("m", "cpu", "float32", kv_bytes_per_token=1024, block_size=16,
                prefill=LinearFit(PREFILL_TERMS, (1e-4, 0.0, 0.01), 1.0),
                decode=LinearFit(DECODE_TERMS, (0.0, 0.0, 1e-3, 0.05, 0.04), 1.0))
    cluster = ClusterSpec(1, 1, kv_latency_s=0.0, kv_bandwidth=1e30)
    alone = simulate(p, cluster, _one([0.0], [100], [9]))
    assert alone.tpot[0] == pytest.approx(0.051)
    # P takes the first prompt alone (0.02 s), then the second (done at 0.04 s); D runs the first's first
    # step alone (to 0.071 s), the second joins for 7 steps of two rows, then runs its last step alone
    pair = simulate(p, cluster, _one([0.0, 0.0], [100, 100], [9, 9]))
    two = 0.05 + 2e-3 + 0.04
    assert pair.tpot == pytest.approx([(0.051 + 7 * two) / 8, (0.031 + 7 * two + 0.051) / 8])


def test_steps_beside_a_busy_pool_are_slowed_only_while_it_works() -> None:
    """On one CPU host P and D share caches and memory bandwidth: a decode step that starts while P works costs
    decode_slowdown_beside_prefill × its model time, one that starts after P went idle costs the model time;
    a prefill that starts while D works costs prefill_slowdown_beside_decode ×."""
    from pdserve.planner.profile import DECODE_TERMS, PREFILL_TERMS, LinearFit

    p = Profile("m", "cpu", "float32", kv_bytes_per_token=1024, block_size=16,
                prefill=LinearFit(PREFILL_TERMS, (1e-4, 0.0, 0.01), 1.0),
                decode=LinearFit(DECODE_TERMS, (0.0, 0.0, 0.0, 0.05, 0.0), 1.0))
    cluster = ClusterSpec(1, 1, kv_latency_s=0.0, kv_bandwidth=1e30, decode_slowdown_beside_prefill=2.0,
                          prefill_slowdown_beside_decode=1.5)
    # A decodes 39 steps from t = 0.011; B's 2,000-token prompt (0.21 s alone) arrives at 0.5 while D works
    r = simulate(p, cluster, _one([0.0, 0.5], [10, 2000], [40, 1]))
    p_end = 0.5 + 0.21 * 1.5
    assert r.ttft[1] == pytest.approx(p_end - 0.5)
    t, beside = 0.011, 0.0
    for _ in range(39):
        cost = 0.1 if 0.5 <= t < p_end else 0.05
        beside += cost if cost > 0.05 else 0.0
        t += cost
    assert r.e2e[0] == pytest.approx(t)
    assert r.decode_busy_beside_prefill_s == pytest.approx(beside)
    assert r.prefill_busy_beside_decode_s == pytest.approx(0.21 * 1.5)
    alone = simulate(p, replace(cluster, decode_slowdown_beside_prefill=1.0, prefill_slowdown_beside_decode=1.0),
                     _one([0.0, 0.5], [10, 2000], [40, 1]))
    assert alone.e2e[0] == pytest.approx(0.011 + 39 * 0.05)
    with pytest.raises(ValueError, match="slowdowns must be positive"):
        ClusterSpec(1, 1, decode_slowdown_beside_prefill=0.0)
