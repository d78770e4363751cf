"""Admin API, status.json and deregistration on a router with FAKE workers (the real ones: tests/deploy)."""

from __future__ import annotations

import httpx

from pdserve.router.registry import WorkerLoad, WorkerRegistry

TOKEN = "router-admin-token"


def test_admin_api_is_off_without_a_token(make_cluster) -> None:
    cluster = make_cluster()
    response = httpx.get(f"{cluster.url}/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"


def test_status_json_counts_requests_and_pools(make_cluster) -> None:
    cluster = make_cluster(num_prefill=1, num_decode=2, admin_token=TOKEN)
    client = cluster.client()
    for _ in range(3):
        client.completions.create(model="smollm2-135m-instruct", prompt="hello there", max_tokens=3)
    status = httpx.get(f"{cluster.url}/status.json").json()
    assert status["latency"]["count"] == 3 and status["latency"]["ttft_p50_s"] > 0
    assert status["requests"] == {"200": 3}
    assert status["pools"]["decode"]["workers"] == 2 and status["pools"]["prefill"]["available"] == 1
    assert {w["health"] for w in status["workers"]} == {"ok"}
    page = httpx.get(f"{cluster.url}/status")
    assert page.headers["content-type"].startswith("text/html") and '"count": 3' in page.text
    assert "<script src" not in page.text and "<link rel=\"stylesheet\"" not in page.text  # no external assets


def test_routing_policy_swap_and_unknown_names(make_cluster) -> None:
    cluster = make_cluster(admin_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    answer = httpx.put(f"{cluster.url}/admin/routing-policy", headers=auth, json={"decode_policy": "round_robin"})
    assert answer.json()["decode_policy"] == "round_robin" and cluster.state.admin.decode_policy == "round_robin"
    assert cluster.client().completions.create(model="smollm2-135m-instruct", prompt="x", max_tokens=2).choices
    extra = httpx.put(f"{cluster.url}/admin/routing-policy", headers=auth, json={"policy": "x"})
    assert extra.status_code == 400


def test_deregistered_worker_is_forgotten_at_once(make_cluster) -> None:
    cluster = make_cluster(num_prefill=0, num_decode=0, static=False)
    body = {"worker_id": "w9", "url": "http://127.0.0.1:9", "roles": ["decode"]}
    assert httpx.post(f"{cluster.url}/internal/workers/register", json=body).status_code == 200
    assert httpx.post(f"{cluster.url}/internal/workers/deregister", json={"worker_id": "w9"}).status_code == 200
    assert httpx.get(f"{cluster.url}/internal/workers").json()["workers"] == []
    again = httpx.post(f"{cluster.url}/internal/workers/deregister", json={"worker_id": "w9"})
    assert again.status_code == 404


def test_roles_change_only_through_the_admin_api_and_draining_leaves_candidates() -> None:
    registry = WorkerRegistry(timeout_s=3.0)
    registry.register("w", "http://w", ("decode",))
    registry.set_roles("w", ("prefill",))
    registry.heartbeat("w", WorkerLoad())  # a report sent before the switch does not switch it back
    assert [w.worker_id for w in registry.candidates("prefill")] == ["w"] and registry.candidates("decode") == []
    registry.get("w").draining = True
    assert registry.candidates("prefill") == [] and registry.describe(registry.get("w"))["health"] == "draining"
    assert registry.deregister("w") is not None and registry.workers() == []
