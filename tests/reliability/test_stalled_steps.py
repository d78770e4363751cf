"""A worker whose model step hangs while its event loop runs on (issue 16, item 2): it answers PINGs and
heartbeats, so only its step progress shows it (engine/step_liveness.py, router/health.py).

Beside the deployment (`pdserve serve --num-prefill 2 --num-decode 2`'s launcher, tests/reliability/cluster.py)
an extra worker registers with the router carrying the test-only fault `--fault-hang-step-after N`: its forward
after the N-th blocks for good. A decode worker's streams then end with an OpenAI error event within
--stream-stall-timeout (4 s) + 2 s of their last token, the other decode workers' streams finish every token,
new requests succeed on them, the router lists the worker as stalled, and every other pool ends idle (the hung
worker keeps the blocks of the batch its forward may still write). A prefill worker's prompts are retried on the
other prefill workers once it is found stalled (or recomputed by D, whose 4 s KV lease here races the 4 s stall
timeout), and all succeed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.cluster import AUTH, WORKER_FLAGS, Cluster, Proc, metric
from tests.reliability.streams import StreamResult, stream_completion

STALL_S = 4.0  # the router's default --stream-stall-timeout
CUT_WITHIN_S = STALL_S + 2.0
STREAMS = 6
MAX_TOKENS = 64
HANG_AFTER_STEPS = 12  # the hung decode worker's streams have their first tokens before it stops


def entry(cluster: Cluster, name: str) -> dict | None:
    return next((w for w in cluster.registry() if w["worker_id"] == name), None)


@pytest.fixture
def hanging(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Proc]:
    """An extra registered worker of the given role whose forward after `HANG_AFTER_STEPS` (decode) or its first
    (prefill) hangs; killed afterwards, and the deployment healed and idle."""
    role = request.param
    cluster.wait_deployment()
    cluster.wait_idle()
    after = HANG_AFTER_STEPS if role == "decode" else 0
    proc = cluster.start_worker(role, f"{role}-hang", *WORKER_FLAGS, "--fault-hang-step-after", str(after))
    try:
        cluster.wait_ready(proc)
        yield proc
    finally:
        cluster.retire(proc)
        cluster.wait_deployment()
        cluster.wait_idle()


async def _streams(cluster: Cluster, count: int, tag: str, max_tokens: int) -> list[StreamResult]:
    async with httpx.AsyncClient(base_url=cluster.url, headers=AUTH, timeout=120) as client:
        return await asyncio.gather(*(stream_completion(client, f"{tag} stream {i}:", max_tokens, ignore_eos=True,
                                                        temperature=0.0) for i in range(count)))


@pytest.mark.parametrize("hanging", ["decode"], indirect=True)
def test_a_decode_step_that_hangs_ends_its_streams_and_the_worker_is_routed_around(cluster: Cluster,
                                                                                  hanging: Proc) -> None:
    stalled_before = metric(cluster.router, "pdserve_stalled_workers_total")
    results = asyncio.run(_streams(cluster, STREAMS, "Stalled decode", MAX_TOKENS))
    cut = [r for r in results if r.error is not None]
    whole = [r for r in results if r.error is None]
    assert cut, "no stream landed on the hung decode worker"
    assert all(r.error["code"] == "worker_failed" and hanging.name in r.error["message"]
               and "no progress" in r.error["message"] for r in cut), [r.error for r in cut]
    # from its last token (the step before the hung one) to the error event
    worst = max(r.ended_at - (r.last_at or r.sent_at) for r in cut)
    assert worst < CUT_WITHIN_S, f"a stream of the hung decode worker ended {worst:.2f} s after its last token"
    assert all(r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS for r in whole)
    info = entry(cluster, hanging.name)
    assert info is not None and info["stalled"], info
    assert metric(cluster.router, "pdserve_stalled_workers_total") == stalled_before + 1
    started = time.monotonic()
    fresh = asyncio.run(_streams(cluster, 4, "After the stall", 8))
    assert all(r.status == 200 and r.error is None and r.completion_tokens == 8 for r in fresh), \
        [(r.status, r.error) for r in fresh]
    fresh_s = max(r.ended_at for r in fresh) - started
    # its event loop answers; the hung step keeps its batch's blocks (the forward may still write them), the
    # other pools are idle (the fixture's teardown checks them)
    assert cluster.status(hanging)["step_stalled_s"] > STALL_S
    print(f"\nRELIABILITY decode_step_hang: {len(cut)} of {STREAMS} streams on the hung decode worker got an error "
          f"event at most {worst:.2f} s after their last token (--stream-stall-timeout {STALL_S:g}), "
          f"{len(whole)} finished all {MAX_TOKENS} tokens; 4/4 new requests served by the others in "
          f"{fresh_s:.2f} s; the hung worker listed as stalled")


@pytest.mark.parametrize("hanging", ["prefill"], indirect=True)
def test_a_prefill_forward_that_hangs_is_retried_on_another_prefill_worker(cluster: Cluster,
                                                                          hanging: Proc) -> None:
    def rescued() -> float:
        """Prompts the router retried, and reservations whose KV never came that D recomputed (its lease, 4 s
        here, races the stall timeout, 4 s: either rescues a prompt held by the hung worker)."""
        return metric(cluster.router, "pdserve_retries_total") + sum(
            metric(p, "pdserve_decode_kv_recomputes_total") for p in cluster.live("decode"))

    rescued_before = rescued()
    started = time.monotonic()
    results = asyncio.run(_streams(cluster, STREAMS, "Stalled prefill", 8))
    assert all(r.status == 200 and r.error is None and r.completion_tokens == 8 for r in results), \
        [(r.status, r.error) for r in results]
    retries = rescued() - rescued_before
    assert retries >= 1, "no prompt was sent to the hung prefill worker"
    worst = max(r.ended_at for r in results) - started
    assert worst < CUT_WITHIN_S + 10, worst  # the stall found, then a prefill and 8 tokens on the others
    info = entry(cluster, hanging.name)
    assert info is not None and info["stalled"], info
    print(f"\nRELIABILITY prefill_step_hang: {STREAMS}/{STREAMS} requests served, {retries:.0f} rescue events for the "
          f"prompts the hung prefill worker held (router retries once it was found stalled, and D's recomputes when "
          f"the KV lease ran out first); the last answered {worst:.2f} s after sending")
