"""Workers killed with SIGKILL while they work, on real processes.

A decode worker killed mid-stream: its streams end with an error event within 5 s, the other streams finish
untouched, the router stops routing to it, and no other worker keeps a block. A prefill worker killed
mid-prefill: the request is retried on the other prefill worker and succeeds; with none left, a clear 503
with Retry-After."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
from cluster import AUTH, MODEL, Cluster, Proc, metric, wait_until
from streams import stream_completion

STREAMS = 6
MAX_TOKENS = 96


def running(cluster: Cluster, procs: list[Proc]) -> dict[str, int]:
    return {p.name: cluster.status(p)["num_running"] for p in procs}


async def _kill_decode_mid_stream(cluster: Cluster) -> tuple[list, float, Proc, int]:
    decodes = cluster.live("decode")
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=60) as client:
        tasks = [asyncio.create_task(stream_completion(client, list(range(500 + 7 * i, 530 + 7 * i)), MAX_TOKENS,
                                                       ignore_eos=True, temperature=0.0)) for i in range(STREAMS)]
        counts = await asyncio.to_thread(wait_until, lambda: (c := running(cluster, decodes)) and
                                         sum(c.values()) == STREAMS and c, 60, "every stream decoding")
        victim = max(decodes, key=lambda p: counts[p.name])
        await asyncio.sleep(0.5)  # tokens are flowing on every stream
        killed_at = time.monotonic()
        victim.kill()
        routed_away_s = await asyncio.to_thread(
            wait_until, lambda: routed_away(cluster, victim) and time.monotonic() - killed_at, 5, "routed away")
        results = await asyncio.gather(*tasks)
    return results, killed_at, victim, counts[victim.name], routed_away_s


def routed_away(cluster: Cluster, victim: Proc) -> bool:
    """The router no longer offers the worker new work: unreachable, or dropped from its registry."""
    entry = next((w for w in cluster.registry() if w["worker_id"] == victim.name), None)
    return entry is None or not entry["reachable"]


def test_decode_worker_killed_mid_stream(healthy: Cluster) -> None:
    cluster = healthy
    results, killed_at, victim, on_victim, dropped_s = asyncio.run(_kill_decode_mid_stream(cluster))
    cluster.retire(victim)
    cut = [r for r in results if r.error is not None]
    whole = [r for r in results if r.error is None]
    assert len(cut) == on_victim >= 1, [(r.error, r.finish_reason) for r in results]
    worst = max(r.ended_at - killed_at for r in cut)
    assert worst < 5.0, f"a stream of the killed worker hung for {worst:.2f} s"
    assert all(r.error["code"] == "worker_failed" and victim.name in r.error["message"] for r in cut)
    assert all(r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS for r in whole)
    assert routed_away(cluster, victim)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": MODEL, "prompt": f"Request {i} after the crash:", "max_tokens": 4}), range(8)))
    assert [r.status_code for r in replies] == [200] * 8
    statuses = cluster.wait_idle()  # the prefill workers and the surviving decode worker hold no block
    assert set(statuses) == {p.name for p in cluster.live()}
    print(f"\nRELIABILITY decode_kill: {len(cut)} of {STREAMS} streams on the killed worker got an error event "
          f"after at most {worst:.2f} s, {len(whole)} finished untouched; routed away after {dropped_s:.2f} s; "
          f"8/8 requests after it succeeded; every pool idle")


def _prefilling(cluster: Cluster) -> Proc | None:
    """The prefill worker holding a request (a worker's num_running is its decode batch's)."""
    return next((p for p in cluster.live("prefill") if cluster.status(p)["queue_len"] > 0), None)


def _long_request(cluster: Cluster, first_token: int) -> httpx.Response:
    prompt = [(first_token + 37 * i) % 40000 + 100 for i in range(600)]  # two chunks on P (512 tokens a forward)
    return httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0})


def test_prefill_worker_killed_mid_prefill(healthy: Cluster) -> None:
    cluster = healthy
    retries_before = metric(cluster.router, "pdserve_retries_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_long_request, cluster, 11)
        victim = wait_until(lambda: _prefilling(cluster), 60, "a prefill worker prefilling")
        time.sleep(0.5)
        started = time.monotonic()
        cluster.retire(victim)
        retried = pending.result()
        retried_s = time.monotonic() - started
    assert retried.status_code == 200, retried.text
    assert retried.json()["choices"][0]["finish_reason"] == "length"
    assert metric(cluster.router, "pdserve_retries_total") > retries_before

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the last prefill worker dies too
        pending = pool.submit(_long_request, cluster, 23)
        last = wait_until(lambda: _prefilling(cluster), 60, "the last prefill worker prefilling")
        time.sleep(0.5)
        started = time.monotonic()
        cluster.retire(last)
        # no other P to retry on: the decode worker's KV did not come (its connection from P dropped), and its
        # --kv-load-failure-policy recompute prefills the prompt itself: the request is answered all the same
        recomputed = pending.result()
        recomputed_s = time.monotonic() - started
        refused = _long_request(cluster, 29)  # a new request, with no prefill worker at all: 503 at once
        refused_s = time.monotonic() - started - recomputed_s
    assert recomputed.status_code == 200, recomputed.text
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "no_worker_available"
    assert refused_s < 5.0
    cluster.wait_idle()  # the decode workers freed every reservation
    print(f"\nRELIABILITY prefill_kill: retried on the other prefill worker, answered {retried_s:.2f} s after "
          f"the kill; the last one killed: its request recomputed on D, answered {recomputed_s:.2f} s after; a "
          f"new request then a 503 (Retry-After {refused.headers['retry-after']} s) in {refused_s:.2f} s: "
          f"{refused.json()['error']['message'][:120]}")
