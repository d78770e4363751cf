"""A KV transfer that never completes, on real workers: the decode worker gives its reserved blocks back once
the lease runs out (it counts silence: every KV frame renews it), then follows --kv-load-failure-policy:
`fail` ends the request with an error frame, `recompute` prefills the prompt on D and streams the same greedy
tokens. Through the router, with every prefill worker frozen (SIGSTOP) the request still completes: D
recomputes and the router relays D's tokens at once; once thawed, the prefill workers hold nothing."""

from __future__ import annotations

import signal
import time

import httpx

from pdserve.engine.sampling import SamplingParams
from pdserve.protocol.messages import Reserve, Reserved, TokenDelta
from tests.reliability.cluster import AUTH, MODEL, SECRET, Cluster, Proc, metric
from tests.reliability.data_plane import reserve_and_read

PROMPT = list(range(2000, 2040))  # 40 tokens: 3 blocks reserved
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def reserve_and_stream(cluster: Cluster, proc: Proc, request_id: str) -> tuple[list[TokenDelta], float, int]:
    """Reserve on D's data plane directly, send no KV, read the deltas to the last: (deltas, seconds, the lowest
    free-block count seen while the request was held)."""
    status = cluster.status(proc)
    total, port = status["total_blocks"], status["data_port"]
    answer, deltas, seconds = reserve_and_read("127.0.0.1", port, SECRET,
                                               Reserve(request_id, PROMPT, GREEDY, None, time.time()))
    assert isinstance(answer, Reserved), answer
    return deltas, seconds, total - len(answer.transfer["block_ids"])


def test_fail_policy_ends_the_request_after_the_lease_and_frees_its_blocks(cluster: Cluster) -> None:
    fail_d = cluster.workers["decode-fail"]  # --kv-lease-timeout 1 --kv-load-failure-policy fail
    total = cluster.status(fail_d)["total_blocks"]
    frames, seconds, held = reserve_and_stream(cluster, fail_d, "no-kv-fail")
    assert held == total - 3
    [frame] = frames
    assert frame.finish_reason == "error" and "lease of 1.000 s expired" in frame.error, frame
    assert 0.8 < seconds < 3.0
    assert cluster.status(fail_d)["free_blocks"] == total
    print(f"\nRELIABILITY kv_lease_fail: error frame {seconds:.2f} s after reserve (lease 1 s), blocks freed")


def test_recompute_policy_streams_the_reference_tokens(cluster: Cluster, reference_llm) -> None:
    decode = cluster.live("decode")[0]  # --kv-lease-timeout 4, default policy recompute
    frames, seconds, _ = reserve_and_stream(cluster, decode, "no-kv-recompute")
    [expected] = reference_llm.generate([PROMPT], SamplingParams(**GREEDY))
    assert [t for f in frames for t in f.token_ids] == expected.token_ids
    assert frames[-1].finish_reason == expected.finish_reason and not any(f.error for f in frames)
    assert 3.5 < seconds < 20
    assert metric(decode, "pdserve_decode_kv_recomputes_total") >= 1
    cluster.wait_idle()
    print(f"\nRELIABILITY kv_lease_recompute: {len(expected.token_ids)} reference tokens, last one "
          f"{seconds:.2f} s after reserve (lease 4 s)")


def test_frozen_prefill_workers_cost_a_lease_not_the_request(cluster: Cluster, reference_llm) -> None:
    prefills = cluster.live("prefill")
    prompt = list(range(3000, 3050))
    [expected] = reference_llm.generate([prompt], SamplingParams(**GREEDY))
    for _ in prefills:  # the router's data-plane links to both are up, as in a deployment that has served
        assert httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": MODEL, "prompt": prompt[:20], **GREEDY}).status_code == 200
    for proc in prefills:
        proc.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": MODEL, "prompt": prompt, **GREEDY})
        seconds = time.monotonic() - started
    finally:
        for proc in prefills:
            proc.signal(signal.SIGCONT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected.text
    assert 4.0 < seconds < 25, seconds  # lease 4 s + D's own prefill (its first token is relayed at once)
    statuses = cluster.wait_idle()  # thawed P's compute, find D gone, and free what they held
    assert all(s["free_blocks"] == s["total_blocks"] for s in statuses.values())
    print(f"\nRELIABILITY kv_stall_router: both prefill workers frozen, answer in {seconds:.2f} s "
          f"(recomputed on D), every pool idle after thawing")
