"""A burst of 10x the router's capacity (--max-inflight-requests) at once, on real processes: what does not fit
is refused at once with 429 (router full) or 503 (every prefill queue / decode waiting queue full:
--max-queued-requests), each with Retry-After; nothing else fails; every process's memory stays within a
bound of where it was after a burst at capacity; and the service recovers by itself."""

from __future__ import annotations

import asyncio
import collections
import time

import httpx

from tests.reliability.cluster import AUTH, MAX_INFLIGHT, MODEL, Cluster, metric, rss_mb

BURST = 10 * MAX_INFLIGHT
RSS_GROWTH_MB = 64.0  # per process, beyond a burst at capacity (torch's allocator keeps what a batch needed)


async def burst(cluster: Cluster, count: int) -> tuple[list[tuple[int, str | None]], float]:
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120, limits=limits) as client:
        async def one(i: int) -> tuple[int, str | None]:
            reply = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Burst request number {i} asks for a short story about", "max_tokens": 4})
            return reply.status_code, reply.headers.get("retry-after")

        started = time.monotonic()
        replies = await asyncio.gather(*(one(i) for i in range(count)))
        return replies, time.monotonic() - started


def memory(cluster: Cluster) -> dict[str, float]:
    procs = [cluster.router, *cluster.live()]
    return {proc.name: rss_mb(proc.pid) for proc in procs if proc is not None}


def test_ten_times_capacity_is_refused_fast_memory_stays_bounded_and_service_recovers(healthy: Cluster) -> None:
    cluster = healthy
    warm, _ = asyncio.run(burst(cluster, MAX_INFLIGHT))  # at capacity: the batch sizes a worker allocates for
    assert {status for status, _ in warm} <= {200, 429, 503}
    cluster.wait_idle()
    before = memory(cluster)
    refused_before = metric(cluster.router, 'pdserve_requests_total{status="429"}')

    replies, seconds = asyncio.run(burst(cluster, BURST))
    statuses = collections.Counter(status for status, _ in replies)
    assert set(statuses) <= {200, 429, 503}, statuses
    assert statuses[200] >= MAX_INFLIGHT // 4 and statuses[429] >= BURST - 2 * MAX_INFLIGHT, statuses
    assert all(retry_after and int(retry_after) >= 1 for status, retry_after in replies if status != 200)
    assert metric(cluster.router, 'pdserve_requests_total{status="429"}') - refused_before == statuses[429]

    cluster.wait_idle()  # recovers by itself: every queue empties, every block comes back
    after = memory(cluster)
    growth = {name: after[name] - before[name] for name in before if name in after}
    assert max(growth.values()) < RSS_GROWTH_MB, growth
    recovered, _ = asyncio.run(burst(cluster, 16))
    assert [status for status, _ in recovered] == [200] * 16
    print(f"\nRELIABILITY overload: {BURST} requests at once ({BURST // MAX_INFLIGHT}x --max-inflight-requests "
          f"{MAX_INFLIGHT}) answered in {seconds:.1f} s: {statuses[200]} x 200, {statuses[429]} x 429, "
          f"{statuses[503]} x 503, all refusals with Retry-After; RSS MB before -> after: "
          + ", ".join(f"{n} {before[n]:.0f}->{after[n]:.0f}" for n in before if n in after)
          + "; 16/16 requests after it succeeded")
