"""The workers' side of docs/internal_api.md, called directly (no router): reserve until D is full (503 with
retry_after), aborts that free at once, one stream per request, P refusing a target that does not fit."""

from __future__ import annotations

import httpx

from tests.e2e.deployments import INTERNAL, Deployment

GREEDY = {"max_tokens": 4, "temperature": 0.0}


def reserve(client: httpx.Client, decode: str, request_id: str, num_tokens: int) -> httpx.Response:
    body = {"request_id": request_id, "prompt_token_ids": list(range(1000, 1000 + num_tokens)), "sampling": GREEDY,
            "cache_salt": None, "arrival_time": 0.0}
    return client.post(f"{decode}/internal/reserve", json=body)


def test_reserve_until_full_then_abort_frees_everything(disaggregated: Deployment) -> None:
    decode = disaggregated.worker_url("decode")
    free_before = disaggregated.status("decode")["free_blocks"]
    with httpx.Client(headers=INTERNAL, timeout=10) as client:
        reserved = []
        while True:
            reply = reserve(client, decode, f"fill-{len(reserved)}", 600)  # 38 blocks of 16 each
            if reply.status_code != 200:
                break
            target = reply.json()["transfer"]
            assert target["backend"] == "tcp" and len(target["block_ids"]) == 38 and target["port"] > 0
            reserved.append(reply.json()["request_id"])
        assert reply.status_code == 503, reply.text
        assert reply.json()["retry_after"] > 0 and "38 KV blocks needed" in reply.json()["error"]["message"]
        assert len(reserved) == (free_before - 1) // 38  # one block is kept free for running requests to grow
        for request_id in reserved:
            assert client.post(f"{decode}/internal/abort/{request_id}").json() == {"request_id": request_id,
                                                                                  "aborted": True}
        assert client.post(f"{decode}/internal/abort/{reserved[0]}").json()["aborted"] is False
    assert disaggregated.status("decode")["free_blocks"] == free_before


def test_one_stream_per_request_and_unknown_ids(disaggregated: Deployment) -> None:
    decode = disaggregated.worker_url("decode")
    with httpx.Client(headers=INTERNAL, timeout=10) as client:
        assert client.post(f"{decode}/internal/stream/nobody").status_code == 404
        assert reserve(client, decode, "twice", 20).status_code == 200
        with client.stream("POST", f"{decode}/internal/stream/twice") as first:
            assert first.status_code == 200
            second = client.post(f"{decode}/internal/stream/twice")
            assert second.status_code == 409 and "already being streamed" in second.json()["error"]["message"]
            client.post(f"{decode}/internal/abort/twice")
            frames = first.read()
        assert frames  # the final "abort" frame


def test_prefill_refuses_a_target_it_cannot_fill(disaggregated: Deployment) -> None:
    decode, prefill = disaggregated.worker_url("decode"), disaggregated.worker_url("prefill")
    with httpx.Client(headers=INTERNAL, timeout=10) as client:
        target = reserve(client, decode, "mismatch", 40).json()["transfer"]  # 3 blocks
        body = {"request_id": "mismatch", "prompt_token_ids": list(range(1000, 1100)), "sampling": GREEDY,
                "cache_salt": None, "transfer": target}  # 100 tokens need 7 blocks
        reply = client.post(f"{prefill}/internal/prefill", json=body)
        assert reply.status_code == 400 and "has 3 blocks" in reply.json()["error"]["message"]
        assert client.post(f"{prefill}/internal/prefill", json={"request_id": 5}).status_code == 400
        client.post(f"{decode}/internal/abort/mismatch")
