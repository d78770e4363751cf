"""WorkerRegistry (with a settable clock) and the /internal/workers endpoints (real HTTP)."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.router.registry import WorkerLoad, WorkerRegistry

MODEL = "smollm2-135m-instruct"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_registered_worker_expires_without_heartbeats() -> None:
    clock = Clock()
    registry = WorkerRegistry(timeout_s=3.0, clock=clock)
    registry.register("d0", "http://d0/", ("decode",))
    clock.now += 2.5
    assert registry.heartbeat("d0", WorkerLoad(free_blocks=5, total_blocks=10)) is not None
    clock.now += 2.9
    assert registry.expire() == [] and [w.worker_id for w in registry.candidates("decode")] == ["d0"]
    clock.now += 0.2
    assert [w.worker_id for w in registry.candidates("decode")] == []  # stale before the sweep removes it
    assert [w.worker_id for w in registry.expire()] == ["d0"] and registry.workers() == []
    assert registry.heartbeat("d0", WorkerLoad()) is None  # unknown now: it must register again


def test_static_workers_never_expire_and_merge_roles() -> None:
    clock = Clock()
    registry = WorkerRegistry(timeout_s=1.0, clock=clock)
    registry.add_static("http://w:1", "prefill")
    worker = registry.add_static("http://w:1/", "decode")
    assert worker.roles == ("prefill", "decode") and len(registry.workers()) == 1
    assert registry.candidates("prefill") == []  # unreachable until its first status answer
    registry.heartbeat(worker.worker_id, WorkerLoad())
    clock.now += 100
    assert registry.expire() == [] and registry.candidates("decode") == [worker]


def test_candidates_skip_draining_and_unreachable() -> None:
    registry = WorkerRegistry(timeout_s=3.0)
    for name in ("a", "b", "c"):
        registry.register(name, f"http://{name}", ("prefill", "decode"))
    registry.heartbeat("b", WorkerLoad(draining=True))
    registry.mark_unreachable("c")
    assert [w.worker_id for w in registry.candidates("prefill")] == ["a"]
    registry.heartbeat("c", WorkerLoad())  # a report makes it reachable again
    assert [w.worker_id for w in registry.candidates("decode")] == ["a", "c"]


def test_bad_roles_are_refused() -> None:
    with pytest.raises(ValueError, match="roles"):
        WorkerRegistry(timeout_s=1.0).register("x", "http://x", ("both",))


def _register_body(worker_id: str, url: str, roles: list[str], **extra: object) -> dict:
    return {"worker_id": worker_id, "url": url, "roles": roles, "model": MODEL, "max_model_len": 2048,
            "block_size": 16, "num_blocks": 500, "transfer": {"backend": "tcp", "host": "127.0.0.1", "port": 1},
            **extra}


def test_register_heartbeat_list_and_expiry_over_http(make_cluster) -> None:
    # a timeout of 1 s, not less: on a busy 2-core machine a heartbeat loop can stall for a few 100 ms
    cluster = make_cluster(num_prefill=0, num_decode=0, static=False, heartbeat_interval_s=0.2,
                           heartbeat_timeout_s=1.0)
    url = cluster.url
    answer = httpx.post(f"{url}/internal/workers/register", json=_register_body("w1", "http://10.0.0.1:9", ["decode"]))
    assert answer.status_code == 200 and answer.json() == {"heartbeat_interval_s": 0.2}
    heartbeat = {"worker_id": "w1", "roles": ["decode"], "queue_len": 1, "num_running": 2, "num_waiting": 3,
                 "free_blocks": 400, "total_blocks": 500, "draining": False}
    for _ in range(8):  # 1.6 s of heartbeats: longer than the timeout
        assert httpx.post(f"{url}/internal/workers/heartbeat", json=heartbeat).status_code == 200
        time.sleep(0.2)
    (worker,) = httpx.get(f"{url}/internal/workers").json()["workers"]
    assert worker["worker_id"] == "w1" and worker["load"]["num_running"] == 2 and worker["kv_usage"] == 0.2
    assert 'pdserve_worker_num_running{worker_id="w1"} 2.0' in httpx.get(f"{url}/metrics").text
    deadline = time.monotonic() + 4
    while httpx.get(f"{url}/internal/workers").json()["workers"]:
        assert time.monotonic() < deadline, "the silent worker was not dropped"
        time.sleep(0.05)
    assert 'worker_id="w1"' not in httpx.get(f"{url}/metrics").text
    gone = httpx.post(f"{url}/internal/workers/heartbeat", json=heartbeat)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "worker_not_found"


def test_registered_workers_serve_requests(make_cluster) -> None:
    cluster = make_cluster(static=False)
    for worker, server, role in ((cluster.prefill[0], cluster.prefill_servers[0], "prefill"),
                                 (cluster.decode[0], cluster.decode_servers[0], "decode")):
        body = _register_body(worker.worker_id, server.url, [role], data_port=worker.data.port)
        assert httpx.post(f"{cluster.url}/internal/workers/register", json=body).status_code == 200
    out = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


@pytest.mark.parametrize(("extra", "param"), [({"model": "other"}, "model"), ({"block_size": 32}, "block_size"),
                                              ({"roles": ["both"]}, "roles"), ({"url": "ftp://x"}, "url")])
def test_registration_is_checked(make_cluster, extra: dict, param: str) -> None:
    cluster = make_cluster(num_prefill=0, num_decode=0, static=False)
    body = {**_register_body("w", "http://127.0.0.1:9", ["decode"]), **extra}
    response = httpx.post(f"{cluster.url}/internal/workers/register", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_shared_secret_guards_internal_routes(make_cluster) -> None:
    cluster = make_cluster(secret="s3cret")
    denied = httpx.get(f"{cluster.url}/internal/workers")
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    wrong = httpx.get(f"{cluster.url}/internal/workers", headers={"X-PDServe-Secret": "nope"})
    assert wrong.status_code == 401
    allowed = httpx.get(f"{cluster.url}/internal/workers", headers={"X-PDServe-Secret": "s3cret"})
    assert allowed.status_code == 200 and len(allowed.json()["workers"]) == 2
    assert cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices  # public API open
