"""Frozen workers (SIGSTOP) in a deployment started as `pdserve serve --num-prefill 2 --num-decode 2` starts it
(issue 16, item 2): a frozen decode worker's streams end with an OpenAI error event once its data-plane link
has been silent for --stream-stall-timeout (4 s by default; the router pings every quarter of it), the other
streams finish every token, and new requests go around it; a frozen prefill worker costs its requests a retry
on the other one. Thawed (SIGCONT), the worker heartbeats again and takes new work.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.deployments import INTERNAL, MODEL, Deployment, launch

STALL_S = 4.0  # the router's default --stream-stall-timeout


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
          default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("two-by-two", ["--num-prefill", "2", "--num-decode", "2"],
                        tmp_path_factory.mktemp("frozen"), model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def worker_pid(deployment: Deployment, worker_id: str) -> int:
    for pid in deployment.child_pids():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if worker_id.encode() in argv:
            return pid
    raise LookupError(worker_id)


def stream(deployment: Deployment, max_tokens: int, prompt: str = "Tell me a story") -> dict:
    """One streaming completion: its completion tokens (the usage chunk's count; a cut stream has none, so
    its events are counted: the router may merge deltas that queue behind a slow client into one event), an
    error event's message, when it ended."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    tokens, error = 0, None
    with httpx.stream("POST", f"{deployment.url}/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"]:
                tokens += 1
    return {"tokens": tokens, "error": error, "ended": time.monotonic()}


def running_on(deployment: Deployment, worker_id: str) -> int:
    """Sequences the worker itself is decoding (its own /internal/status), not the router's count of requests
    sent to it, which also counts a request still in prefill or a reservation the router then places elsewhere.
    On that count, in a full run on an overloaded host (2026-12-07), decode-0 was frozen and no stream was cut,
    twice: with nothing of its own decoding, a frozen worker ends no stream."""
    [url] = [w["url"] for w in deployment.workers if w["worker_id"] == worker_id]
    return httpx.get(f"{url}/internal/status", headers=INTERNAL, timeout=5).json()["num_running"]


def test_a_frozen_decode_worker_ends_its_streams_and_is_gone_around(pools: Deployment) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, pools, 80, f"Story {i}") for i in range(6)]
        deadline = time.monotonic() + 60
        while not (running_on(pools, "decode-0") and running_on(pools, "decode-1")):
            assert time.monotonic() < deadline, "the streams did not spread over both decode workers"
            time.sleep(0.1)
        pid = worker_pid(pools, "decode-0")
        os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            fresh = pool.submit(stream, pools, 4, "Fresh")
            results = [s.result(timeout=90) for s in streams]
            new = fresh.result(timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
    failed = [r for r in results if r["error"] is not None]
    done = [r for r in results if r["error"] is None]
    assert failed and done, results
    assert all("stalled" in r["error"] or "lost" in r["error"] for r in failed), failed
    assert all(r["ended"] - frozen < STALL_S + 2.0 for r in failed), [r["ended"] - frozen for r in failed]
    assert all(r["tokens"] == 80 for r in done), done
    assert new["error"] is None and new["tokens"] == 4
    assert new["ended"] - frozen < STALL_S + 4.0
    print(f"\nRELIABILITY frozen D: {len(failed)} streams ended with an error "
          f"{max(r['ended'] - frozen for r in failed):.1f} s after SIGSTOP, {len(done)} finished every token, "
          f"a new request answered {new['ended'] - frozen:.1f} s after it; first error: {failed[0]['error'][:160]}")
    rejoined(pools, "decode-0")


def test_a_frozen_prefill_worker_costs_a_retry_on_the_other(pools: Deployment) -> None:
    pid = worker_pid(pools, "prefill-0")
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: stream(pools, 8, f"Question {i}"), range(6)))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(r["error"] is None and r["tokens"] == 8 for r in results), results
    slowest = max(r["ended"] - frozen for r in results)
    assert slowest < STALL_S + 10.0, slowest
    print(f"\nRELIABILITY frozen P: 6 of 6 requests answered, the last {slowest:.1f} s after SIGSTOP")
    rejoined(pools, "prefill-0")


def rejoined(deployment: Deployment, worker_id: str) -> None:
    """Thawed, it heartbeats again: the router lists it healthy, and it serves some of the next requests."""
    deadline = time.monotonic() + 20
    while True:
        workers = httpx.get(f"{deployment.url}/internal/workers", headers=INTERNAL, timeout=5).json()["workers"]
        worker = next((w for w in workers if w["worker_id"] == worker_id), None)
        if worker is not None and worker["reachable"]:
            break
        assert time.monotonic() < deadline, worker
        time.sleep(0.2)
    before = served(worker["url"])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: stream(deployment, 6, f"Again {i}"), range(8)))
    assert all(r["error"] is None for r in results), results
    assert served(worker["url"]) > before, f"{worker_id} took none of 8 requests after it thawed"


def served(url: str) -> float:
    """Requests the worker finished or prefilled so far (its /metrics counters)."""
    text = httpx.get(f"{url}/metrics", headers=INTERNAL, timeout=5).text
    names = ("pdserve_decode_requests_finished_total", "pdserve_prefill_requests_completed_total")
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(names))
