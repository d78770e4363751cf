"""The router's admin API against compose's topology (real workers): the bearer token, the worker list,
routing and cache policies forwarded to every worker, a drain without exit and its resume, refusals.
Every test leaves the topology as it found it (2 P + 2 D, default policies)."""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.topology import Topology, wait_until


def control(worker: dict) -> dict:
    return httpx.get(f"{worker['url']}/internal/control", timeout=10).json()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-123"},
                                     {"Authorization": "Basic ZGVwbG95OnRlc3Q="}])
def test_admin_calls_without_the_token_get_401(topology: Topology, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/admin/workers"), ("PUT", "/admin/routing-policy"),
                         ("POST", "/admin/workers/x/drain")]:
        response = httpx.request(method, f"{topology.router.url}{path}", headers=headers, json={}, timeout=10)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_admin_token"


def test_worker_list_has_role_load_kv_usage_and_health(topology: Topology) -> None:
    workers = topology.workers_listed()
    assert sorted(w["roles"][0] for w in workers) == ["decode", "decode", "prefill", "prefill"]
    for worker in workers:
        assert worker["health"] == "ok" and 0.0 <= worker["kv_usage"] <= 1.0
        assert worker["load"]["total_blocks"] == 256 and worker["silent_s"] < 3
        assert {"queue_len", "num_running", "num_waiting", "free_blocks", "draining"} <= set(worker["load"])


def test_unknown_worker_and_bad_bodies_are_refused(topology: Topology) -> None:
    missing = topology.admin("PUT", "/workers/nobody/role", json={"role": "decode"})
    assert missing.status_code == 404 and "known workers" in missing.json()["error"]["message"]
    worker = topology.workers_listed()[0]
    bad_role = topology.admin("PUT", f"/workers/{worker['worker_id']}/role", json={"role": "router"})
    assert bad_role.status_code == 400
    bad_policy = topology.admin("PUT", "/routing-policy", json={"decode_policy": "fastest"})
    assert bad_policy.status_code == 400 and "least_kv" in bad_policy.json()["error"]["message"]
    bad_cache = topology.admin("PUT", "/cache-policy", json={"write": "sometimes"})
    assert bad_cache.status_code == 400 and "write_through" in bad_cache.json()["error"]["message"]


def test_routing_policy_changes_at_run_time(topology: Topology) -> None:
    before = topology.admin("GET", "/routing-policy").json()
    changed = topology.admin("PUT", "/routing-policy", json={"prefill_policy": "least_loaded"})
    try:
        assert changed.status_code == 200
        assert changed.json()["prefill_policy"] == "least_loaded"
        assert changed.json()["decode_policy"] == before["decode_policy"]  # left out: unchanged
        status = httpx.get(f"{topology.router.url}/status.json", timeout=10).json()
        assert status["policies"]["prefill"] == "least_loaded"
    finally:
        restore = {k: before[k] for k in ("prefill_policy", "decode_policy")}
        topology.admin("PUT", "/routing-policy", json=restore).raise_for_status()


def test_cache_policy_reaches_every_worker(topology: Topology) -> None:
    before = topology.admin("GET", "/cache-policy").json()["policy"]
    response = topology.admin("PUT", "/cache-policy", json={"device_eviction": "lfu", "write": "none"})
    try:
        assert response.status_code == 200, response.text
        policy = response.json()["policy"]
        assert (policy["device_eviction"], policy["write"]) == ("lfu", "none")
        answers = response.json()["workers"]
        assert len(answers) == 4
        for answer in answers.values():  # what a worker has no tier for is kept, not applied
            assert "device_eviction" in answer["applied"]
            assert set(answer["applied"]) | set(answer["stored_only"]) == set(policy)
        for worker in topology.workers_listed():
            assert control(worker)["cache_policy"]["device_eviction"] == "lfu"
    finally:
        topology.admin("PUT", "/cache-policy", json=before).raise_for_status()


def test_drain_without_exit_then_resume(topology: Topology) -> None:
    worker = next(w for w in topology.workers_listed() if w["roles"] == ["prefill"])
    drained = topology.admin("POST", f"/workers/{worker['worker_id']}/drain", json={"exit": False})
    assert drained.status_code == 200 and drained.json()["worker"]["health"] == "draining"
    wait_until(lambda: control(worker)["drained"], 10, "the idle worker to count as drained")
    switch = topology.admin("PUT", f"/workers/{worker['worker_id']}/role", json={"role": "decode"})
    assert switch.status_code == 409  # no role change while draining
    assert topology.process_of(worker).popen.poll() is None  # still up
    resumed = topology.admin("POST", f"/workers/{worker['worker_id']}/resume")
    assert resumed.status_code == 200 and resumed.json()["worker"]["health"] == "ok"
    assert not control(worker)["draining"]
    wait_until(lambda: topology.healthy_count() == 4, 10, "all four workers healthy again")
