"""compose.yaml's topology under continuous load: decode scaled from 2 to 1 by draining, a prefill worker
switched to decode and a decode worker switched to prefill, all while requests run, and none fails."""

from __future__ import annotations

import re
import signal
import time

import httpx

from tests.deploy.load import ContinuousLoad
from tests.deploy.topology import Topology, wait_until


def by_role(topology: Topology, role: str) -> list[dict]:
    return sorted((w for w in topology.workers_listed() if w["roles"] == [role]), key=lambda w: w["url"])


def counter(worker_url: str, name: str) -> float:
    """A counter of the worker's /metrics (0 when not exported yet)."""
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", httpx.get(f"{worker_url}/metrics", timeout=10).text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def set_role(topology: Topology, worker: dict, role: str) -> dict:
    response = topology.admin("PUT", f"/workers/{worker['worker_id']}/role", json={"role": role})
    assert response.status_code == 200, response.text
    assert response.json()["worker"]["roles"] == [role]
    return response.json()["worker"]


def drain_one_decode(topology: Topology, load: ContinuousLoad) -> dict:
    """Drain a decode worker under load; it finishes its requests, deregisters and exits with status 0."""
    gone = by_role(topology, "decode")[0]
    process = topology.process_of(gone)
    response = topology.admin("POST", f"/workers/{gone['worker_id']}/drain", json={"exit": True})
    assert response.status_code == 200, response.text
    assert response.json()["worker"]["health"] == "draining"  # no new work from this moment
    assert process.popen.wait(timeout=60) == 0, process.log()
    listed = [w["worker_id"] for w in topology.workers_listed()]
    assert gone["worker_id"] not in listed  # deregistered on its way out, not dropped after a timeout
    load.wait_for(4)
    return gone


def test_drain_and_role_switches_under_load_lose_no_request(topology: Topology) -> None:
    started = time.monotonic()
    assert [len(by_role(topology, r)) for r in ("prefill", "decode")] == [2, 2]
    load = ContinuousLoad(topology.router.url, concurrency=4).start()
    try:
        load.wait_for(6)
        drain_one_decode(topology, load)
        assert len(by_role(topology, "decode")) == 1

        switched_to_decode = set_role(topology, by_role(topology, "prefill")[0], "decode")  # P -> D: 1 P, 2 D
        steps_before = counter(switched_to_decode["url"], "pdserve_decode_steps")
        load.wait_for(6)
        assert counter(switched_to_decode["url"], "pdserve_decode_steps") > steps_before

        old_decode = next(w for w in by_role(topology, "decode") if w["worker_id"] != switched_to_decode["worker_id"])
        wait_until(lambda: _status(old_decode)["num_running"] > 0, 30, "the decode worker to hold running requests")
        switched_to_prefill = set_role(topology, old_decode, "prefill")  # D -> P with requests in flight
        prefills_before = counter(switched_to_prefill["url"], "pdserve_prefill_requests_completed")
        load.wait_for(8)
        assert counter(switched_to_prefill["url"], "pdserve_prefill_requests_completed") > prefills_before
    finally:
        result = load.stop()
    assert result.failures == [], f"{len(result.failures)} failed of {result.completed + len(result.failures)}: " \
                                  f"{result.failures[:5]}\n{topology.logs()}"
    assert result.completed >= 24
    assert [len(by_role(topology, r)) for r in ("prefill", "decode")] == [2, 1]
    for worker in topology.workers_listed():  # every request's blocks came back (cached prefixes count as free)
        wait_until(lambda w=worker: _status(w)["free_blocks"] == _status(w)["total_blocks"], 30,
                   f"{worker['worker_id']} to free its blocks")
    print(f"{result.completed} requests in {time.monotonic() - started:.1f} s, none failed")


def _status(worker: dict) -> dict:
    return httpx.get(f"{worker['url']}/internal/status", timeout=10).json()


def test_sigterm_drains_a_worker_under_load(topology: Topology) -> None:
    """What `docker compose stop` or `--scale` down does: SIGTERM; with PDSERVE_DRAIN_ON_SIGTERM (compose.yaml)
    the worker finishes what it holds, deregisters and exits 0 while the load goes on elsewhere."""
    assert topology.services["prefill-cpu"]["environment"]["PDSERVE_DRAIN_ON_SIGTERM"] == "1"
    prefill = by_role(topology, "prefill")
    assert len(prefill) == 2
    process = topology.process_of(prefill[0])
    load = ContinuousLoad(topology.router.url, concurrency=4).start()
    try:
        load.wait_for(4)
        wait_until(lambda: _status(prefill[0])["queue_len"] > 0 or process.exited(), 30, "a queued prefill")
        process.popen.send_signal(signal.SIGTERM)
        assert process.popen.wait(timeout=60) == 0, process.log()
        assert prefill[0]["worker_id"] not in [w["worker_id"] for w in topology.workers_listed()]
        load.wait_for(4)
    finally:
        result = load.stop()
    assert result.failures == [], f"{result.failures[:5]}\n{topology.logs()}"
    assert [len(by_role(topology, r)) for r in ("prefill", "decode")] == [1, 1]
