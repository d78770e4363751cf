"""A decode worker killed (SIGKILL) or frozen (SIGSTOP) while it prefills a request itself (conditional
disaggregation, issue 22; router/decode_reuse.py), in `pdserve serve --num-decode 2`.

A conversation's first turn goes through P to one decode worker, which keeps its history; the second turn's
new message is short enough (under --local-prefill-threshold) that the router sends it to that worker to prefill
itself (`pdserve_local_prefills` counts it). The moment the router has counted it, the worker is killed or
frozen, before any token reached the client: the router retries the request on the other decode worker through P
within 2 s of the kill (its connection resets), or within the heartbeat timeout (3 s) + 2 s of the freeze, and the
client gets its whole answer with no error event; the other decode worker serves new
requests, and every pool ends with all its blocks free or evictable.
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

THRESHOLD = 1024  # --local-prefill-threshold: a second turn of ~600 new tokens goes local
HEARTBEAT_TIMEOUT_S = 3.0  # the router's default (3 x the 1 s heartbeat): a frozen worker is dropped after it
MAX_TOKENS = 12
SYSTEM = "You are a concise assistant."
NEW_TURN = " ".join(f"Note {i}: the lake number {i} lies {i * 7 % 13} km north of village {i * 3 % 17}."
                    for i in range(36))  # ~600 tokens: a local prefill of several hundred ms on one CPU thread


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
          default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("local-faults", ["--num-decode", "2", "--local-prefill-threshold", str(THRESHOLD)],
                        tmp_path_factory.mktemp("local_faults"), model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def workers(deployment: Deployment) -> list[dict]:
    return httpx.get(f"{deployment.url}/internal/workers", headers=INTERNAL, timeout=5).json()["workers"]


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=INTERNAL, timeout=5).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def decode_finished(deployment: Deployment) -> dict[str, float]:
    return {w["worker_id"]: counter(w["url"], "pdserve_decode_requests_finished_total")
            for w in workers(deployment) if w["roles"] == ["decode"] and w["reachable"]}


def worker_pid(deployment: Deployment, worker_id: str) -> int:
    for pid in deployment.child_pids():
        if worker_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return pid
    raise LookupError(worker_id)


def chat(deployment: Deployment, messages: list[dict[str, str]]) -> dict:
    """One streamed greedy chat turn: its text, completion tokens, error event, when its first text and its
    end came."""
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out: dict = {"text": "", "tokens": 0, "error": None, "first": None, "status": None}
    with httpx.stream("POST", f"{deployment.url}/v1/chat/completions", json=body, timeout=120) as reply:
        out["status"] = reply.status_code
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]["message"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    out["first"] = out["first"] or time.monotonic()
                    out["text"] += choice["delta"]["content"]
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
    out["ended"] = time.monotonic()
    return out


def first_turn(deployment: Deployment, tag: str) -> tuple[list[dict[str, str]], str]:
    """A first turn through P; returns the history and the decode worker that holds it."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{tag}: name three lakes."}]
    before = decode_finished(deployment)
    got = chat(deployment, messages)
    assert got["error"] is None and got["tokens"] == MAX_TOKENS, got
    after = decode_finished(deployment)
    [holder] = [name for name in after if after[name] > before.get(name, 0)]
    return [*messages, {"role": "assistant", "content": got["text"]}], holder


def break_during_local_prefill(deployment: Deployment, holder: str, messages: list[dict[str, str]],
                               sig: int) -> tuple[dict, float]:
    """The second turn; `sig` sent to its decode worker once the router counted the turn as local. Returns
    the turn's result and the seconds from the signal to the router's retry (`pdserve_retries_total`)."""
    locals_before = counter(deployment.url, "pdserve_local_prefills_total")
    retries_before = counter(deployment.url, "pdserve_retries_total")
    pid = worker_pid(deployment, holder)
    turn = [*messages, {"role": "user", "content": NEW_TURN}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        second = pool.submit(chat, deployment, turn)
        deadline = time.monotonic() + 60
        while counter(deployment.url, "pdserve_local_prefills_total") == locals_before:
            assert time.monotonic() < deadline and not second.done(), "the second turn did not go local"
            time.sleep(0.005)
        os.kill(pid, sig)
        broken_at = time.monotonic()
        try:
            while counter(deployment.url, "pdserve_retries_total") == retries_before:
                assert time.monotonic() < broken_at + 30 and not second.done(), "the turn was not retried"
                time.sleep(0.01)
            retry_s = time.monotonic() - broken_at
            result = second.result(timeout=90)
        finally:
            if sig == signal.SIGSTOP:
                os.kill(pid, signal.SIGCONT)
    assert result["first"] is None or result["first"] > broken_at, \
        "a token reached the client before the worker broke: it was not in its local prefill any more"
    return result, retry_s


def others_serve(deployment: Deployment) -> None:
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        fresh = list(pool.map(lambda i: chat(deployment, [{"role": "user", "content": f"Fresh question {i}?"}]),
                              range(3)))
    assert all(r["status"] == 200 and r["error"] is None and r["tokens"] == MAX_TOKENS for r in fresh), fresh


def nothing_held(deployment: Deployment) -> None:
    """Every registered worker reachable again and every block free or evictable (the launcher restarted a
    killed worker; a thawed one freed what it held when the router closed its link)."""
    deadline = time.monotonic() + 60
    while True:
        entries = workers(deployment)
        statuses = [httpx.get(f"{w['url']}/internal/status", headers=INTERNAL, timeout=5).json()
                    for w in entries if w["reachable"]]
        if len(statuses) == 3 and all(s["free_blocks"] == s["total_blocks"] and s["num_running"] == 0
                                      and s["queue_len"] == 0 for s in statuses):
            return
        assert time.monotonic() < deadline, statuses
        time.sleep(0.2)


def test_a_decode_worker_killed_during_its_local_prefill(pools: Deployment) -> None:
    messages, holder = first_turn(pools, "Killed")
    result, retry_s = break_during_local_prefill(pools, holder, messages, signal.SIGKILL)
    assert result["error"] is None and result["tokens"] == MAX_TOKENS, result  # retried: nothing had reached it
    assert retry_s < 2.0, f"the turn was retried {retry_s:.2f} s after the kill"  # its connection reset
    others_serve(pools)
    nothing_held(pools)
    print(f"\nRELIABILITY local_prefill_kill: the decode worker killed during its local prefill; the turn was "
          f"retried through P on the other one {retry_s:.2f} s after the kill, all "
          f"{MAX_TOKENS} tokens, no error event; new requests served; every pool free")


def test_a_decode_worker_frozen_during_its_local_prefill(pools: Deployment) -> None:
    nothing_held(pools)
    messages, holder = first_turn(pools, "Frozen")
    result, retry_s = break_during_local_prefill(pools, holder, messages, signal.SIGSTOP)
    assert result["error"] is None and result["tokens"] == MAX_TOKENS, result
    # the router drops it after the heartbeat timeout (or its link's PINGs after --stream-stall-timeout 4 s)
    assert retry_s < HEARTBEAT_TIMEOUT_S + 2.0, f"the turn was retried {retry_s:.2f} s after the freeze"
    others_serve(pools)
    nothing_held(pools)
    print(f"\nRELIABILITY local_prefill_freeze: the decode worker frozen during its local prefill; the turn was "
          f"retried through P on the other one {retry_s:.2f} s after SIGSTOP (heartbeat timeout "
          f"{HEARTBEAT_TIMEOUT_S:g} s), no error event; new requests served; every pool free after the thaw")
