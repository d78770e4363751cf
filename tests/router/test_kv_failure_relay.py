"""The relay watches D's deltas while P works (router/relay.py, router/channel.py): D ending the request before
its first token (its KV lease ran out: --kv-load-failure-policy fail) costs that attempt and the stalled P; D
streaming without P's answer (it recomputed the prompt) is relayed at once, and P is told to stop when the
response ends. FAKE workers (fake_workers.py)."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_workers import expected_text

MODEL = "smollm2-135m-instruct"
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}


def stall(cluster, policy: str) -> None:
    for prefill in cluster.prefill:
        prefill.hang_s = 30.0
    cluster.decode[0].kv_lease_s = 0.3
    cluster.decode[0].kv_failure = policy


def test_kv_failure_on_d_retries_with_another_p_then_503(make_cluster) -> None:
    cluster = make_cluster(num_prefill=2)
    stall(cluster, "fail")
    started = time.monotonic()
    reply = httpx.post(f"{cluster.url}/v1/completions", json=BODY, timeout=30)
    seconds = time.monotonic() - started
    assert reply.status_code == 503 and reply.headers["retry-after"]
    message = reply.json()["error"]["message"]
    assert message.count("before its first token (error: lease of 0.3 s expired)") == 2, message
    assert seconds < 5, seconds  # two leases and the undo, not P's 30 s
    assert len(cluster.decode[0].reserved) == 2 and {len(p.prefilled) for p in cluster.prefill} == {1}
    retries = httpx.get(f"{cluster.url}/metrics").text
    assert 'pdserve_retries_total{reason="kv_failed"} 2.0' in retries


@pytest.mark.parametrize("stream", [False, True])
def test_d_that_recomputed_streams_without_waiting_for_p(make_cluster, stream: bool) -> None:
    cluster = make_cluster(num_prefill=1)
    stall(cluster, "recompute")
    started = time.monotonic()
    reply = httpx.post(f"{cluster.url}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
    seconds = time.monotonic() - started
    assert reply.status_code == 200
    if not stream:
        assert reply.json()["choices"][0]["text"] == expected_text(None, 3)
    assert 0.3 < seconds < 2.0, seconds  # the lease, then D's tokens at once: no wait for P's answer
    deadline = time.monotonic() + 5
    while not cluster.prefill[0].aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.prefill[0].aborted == cluster.decode[0].reserved  # P was told to stop
