"""A router keeps each worker's prefix index in step through heartbeats (router/internal_routes.py,
router/prefix_index.py): a snapshot, then numbered events; a gap or another epoch is answered with a resync,
and the next snapshot brings it back. Also: a role switch made through another router reaches this one by
the heartbeat's roles_version. A real router on loopback, heartbeats posted over HTTP as a worker sends them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from uvicorn_thread import ServerThread

from pdserve.cache_store.hashing import block_hashes
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.prefix_events import PrefixEventLog
from pdserve.protocol.prefix_summary import summary_key
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.policies import CacheAware, Prompt

MODEL = "smollm2-135m-instruct"
FP = "fp-test"
TOKENS = list(range(500, 500 + 6 * 16 + 3))  # 6 full blocks


@pytest.fixture
def router(tokenizer: Tokenizer) -> Iterator[tuple[ServerThread, Any]]:
    app = create_app(RouterConfig(model=MODEL, heartbeat_interval_s=5.0), tokenizer)
    with ServerThread(app) as server:
        yield server, app


def _register(url: str, worker_id: str, roles: tuple[str, ...] = ("prefill",)) -> None:
    body = {"worker_id": worker_id, "url": f"http://{worker_id}.invalid:1", "roles": list(roles), "model": MODEL,
            "block_size": 16, "num_blocks": 64, "fingerprint": FP}
    httpx.post(f"{url}/internal/workers/register", json=body, timeout=5).raise_for_status()


def _beat(url: str, worker_id: str, **fields: Any) -> dict[str, Any]:
    reply = httpx.post(f"{url}/internal/workers/heartbeat", json={"worker_id": worker_id, **fields}, timeout=5)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _held(blocks: int) -> list[bytes]:
    return [summary_key(h) for h in block_hashes(TOKENS, 16, FP)[:blocks]]


def test_events_keep_the_index_in_step_and_a_gap_asks_for_a_snapshot(router: tuple[ServerThread, Any]) -> None:
    server, app = router
    _register(server.url, "p0")
    log = PrefixEventLog()
    assert _beat(server.url, "p0", prefix_snapshot=log.snapshot().to_dict())["prefix"] == {"epoch": log.epoch,
                                                                                            "seq": 0}
    log.observe(_held(2))
    log.observe(_held(4))
    events = {"epoch": log.epoch, "events": [e.to_dict() for e in log.since(0)]}
    assert _beat(server.url, "p0", prefix_events=events)["prefix"]["seq"] == 2
    worker = app.state.router.registry.get("p0")
    assert worker.prefixes.matched(block_hashes(TOKENS, 16, FP)) == 4

    log.observe(_held(5))
    log.observe(_held(6))  # seq 4 arrives without seq 3: a gap
    gap = {"epoch": log.epoch, "events": [log.since(3)[0].to_dict()]}
    assert _beat(server.url, "p0", prefix_events=gap)["prefix"] == {"resync": True}
    assert worker.prefixes.matched(block_hashes(TOKENS, 16, FP)) == 4  # stale, kept until the snapshot
    assert _beat(server.url, "p0", prefix_snapshot=log.snapshot().to_dict())["prefix"]["seq"] == 4
    assert worker.prefixes.matched(block_hashes(TOKENS, 16, FP)) == 6

    restarted = PrefixEventLog()  # the worker restarted: its events count from 1 in a new epoch
    restarted.observe(_held(1))
    fresh = {"epoch": restarted.epoch, "events": [e.to_dict() for e in restarted.since(0)]}
    assert _beat(server.url, "p0", prefix_events=fresh)["prefix"] == {"resync": True}


def test_cache_aware_follows_the_events(router: tuple[ServerThread, Any]) -> None:
    server, app = router
    for name in ("p0", "p1"):
        _register(server.url, name)
    log = PrefixEventLog()
    log.observe(_held(6))
    assert _beat(server.url, "p1", prefix_snapshot=log.snapshot().to_dict())["prefix"]["seq"] == 1
    candidates = app.state.router.registry.candidates("prefill")
    policy = CacheAware(16)
    assert [policy.order(candidates, len(TOKENS), Prompt(TOKENS))[0].worker_id for _ in range(4)] == ["p1"] * 4
    listed = httpx.get(f"{server.url}/internal/workers", timeout=5).json()["workers"]
    assert {w["worker_id"]: w["cached_blocks"] for w in listed} == {"p0": 0, "p1": 6}


def test_bad_prefix_bodies_get_400(router: tuple[ServerThread, Any]) -> None:
    server, _ = router
    _register(server.url, "p0")
    reply = httpx.post(f"{server.url}/internal/workers/heartbeat", timeout=5,
                       json={"worker_id": "p0", "prefix_events": {"epoch": "e", "events": [{"seq": -1}]}})
    assert reply.status_code == 400 and "seq" in reply.json()["error"]["message"]


def test_a_newer_roles_version_is_taken_an_older_one_is_not(router: tuple[ServerThread, Any]) -> None:
    server, app = router
    _register(server.url, "w", roles=("prefill",))
    worker = app.state.router.registry.get("w")
    _beat(server.url, "w", roles=["decode"], roles_version=1)  # switched through another router
    assert worker.roles == ("decode",) and worker.roles_version == 1
    _beat(server.url, "w", roles=["prefill"], roles_version=1)  # a report from before that switch
    assert worker.roles == ("decode",)
    _beat(server.url, "w", roles=["prefill"])  # no version (an older worker): roles stay the router's
    assert worker.roles == ("decode",)
