"""Worker-choice policies: unit orderings, and their effect through a real router."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.policies import (
    DECODE_POLICIES,
    PREFILL_POLICIES,
    LeastKV,
    LeastLoaded,
    RoundRobin,
    make_decode_policy,
    make_prefill_policy,
)
from pdserve.router.registry import Worker, WorkerLoad

MODEL = "smollm2-135m-instruct"


def _worker(name: str, **load: int) -> Worker:
    return Worker(worker_id=name, url=f"http://{name}", roles=("prefill", "decode"), static=False, last_seen=0.0,
                  load=WorkerLoad(**load))


def test_round_robin_rotates() -> None:
    policy = RoundRobin()
    workers = [_worker("b"), _worker("a"), _worker("c")]
    firsts = [policy.order(workers, 10)[0].worker_id for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert [w.worker_id for w in policy.order(workers, 10)] == ["a", "b", "c"]  # the rest follow as fallbacks
    assert policy.order([], 10) == []


def test_least_loaded_counts_reported_queue_and_router_inflight() -> None:
    busy, idle, routed = _worker("busy", queue_len=4), _worker("idle"), _worker("routed", num_waiting=1)
    routed.inflight = 2
    assert [w.worker_id for w in LeastLoaded().order([busy, routed, idle], 10)] == ["idle", "routed", "busy"]


def test_least_kv_prefers_free_blocks_and_counts_fresh_reservations() -> None:
    full = _worker("full", free_blocks=100, total_blocks=1000)
    empty = _worker("empty", free_blocks=900, total_blocks=1000)
    assert [w.worker_id for w in LeastKV().order([full, empty], 10)] == ["empty", "full"]
    empty.pending_blocks = 850  # reserved since its last heartbeat
    assert [w.worker_id for w in LeastKV().order([full, empty], 10)] == ["full", "empty"]


def test_policy_names() -> None:
    assert set(PREFILL_POLICIES) == {"cache_aware", "round_robin", "least_loaded"}
    assert set(DECODE_POLICIES) == {"least_kv", "cache_aware", "round_robin"}
    assert isinstance(make_prefill_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_decode_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="unknown decode policy 'least_loaded'"):
        make_decode_policy("least_loaded")
    with pytest.raises(ValueError, match="unknown prefill policy 'fastest'"):
        RouterConfig(model=MODEL, prefill_policy="fastest")


def test_round_robin_spreads_prefill_over_the_pool(make_cluster) -> None:
    cluster = make_cluster(num_prefill=2, num_decode=2, prefill_policy="round_robin", decode_policy="round_robin")
    client = cluster.client()
    for _ in range(4):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert [len(p.prefilled) for p in cluster.prefill] == [2, 2]
    assert [len(d.reserved) for d in cluster.decode] == [2, 2]


def test_least_loaded_avoids_the_busy_prefill_worker(make_cluster) -> None:
    cluster = make_cluster(num_prefill=2, prefill_policy="least_loaded")
    busy, idle = cluster.prefill
    busy.queue_len = 5
    _wait_for_report(cluster, cluster.prefill_servers[0].url, "queue_len", 5)
    client = cluster.client()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert (len(busy.prefilled), len(idle.prefilled)) == (0, 3)


def test_least_kv_picks_the_decode_worker_with_most_free_blocks(make_cluster) -> None:
    cluster = make_cluster(num_decode=2, decode_policy="least_kv")
    crowded, roomy = cluster.decode
    crowded.free_blocks = 100
    _wait_for_report(cluster, cluster.decode_servers[0].url, "free_blocks", 100)
    client = cluster.client()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert (len(crowded.reserved), len(roomy.reserved)) == (0, 3)


def _wait_for_report(cluster, worker_url: str, field: str, value: int) -> None:
    """Static workers (named by URL) are polled every 0.2 s in these clusters."""
    deadline = time.monotonic() + 3
    while not any(w["worker_id"] == worker_url and w["load"][field] == value
                  for w in httpx.get(f"{cluster.url}/internal/workers").json()["workers"]):
        assert time.monotonic() < deadline, f"{worker_url} did not report {field}={value}"
        time.sleep(0.05)
