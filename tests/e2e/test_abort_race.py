"""Abort during the KV transfer, then a new request on the same blocks (issue 16, item 6), through a real
`pdserve serve` (tcp between P and D on this CPU) whose decode pool fits one long prompt at a time: the new
request must reuse the blocks the aborted one had while P was still pushing its layers, and its greedy output
must be what it is on an idle deployment. (On tcp D writes the pool itself and drops a given-up request's late
frames; on cuda_ipc, where P writes D's pool, D holds the blocks until P's "error": tests/kv_transfer.)
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.deployments import MODEL, Deployment, launch

POOL_BLOCKS = 40
VICTIM = list(range(3000, 3560))  # 560 tokens: 35 of the 40 blocks, seconds of prefill layer by layer
SECOND = list(range(5000, 5520))  # 520 tokens: 33 blocks, so it must take the victim's


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
               default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("small-pool", ["--num-blocks", str(POOL_BLOCKS)], tmp_path_factory.mktemp("abort_race"),
                        model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def greedy(deployment: Deployment, prompt: list[int]) -> str:
    reply = httpx.post(f"{deployment.url}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_an_abort_mid_transfer_leaves_the_next_request_on_those_blocks_intact(small_pool: Deployment) -> None:
    expected = greedy(small_pool, SECOND)  # alone, on an idle deployment
    for attempt in range(3):
        body = httpx.Request("POST", "http://x", json={"model": MODEL, "prompt": VICTIM, "max_tokens": 50}).content
        host, port = small_pool.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            while small_pool.status("decode")["free_blocks"] > POOL_BLOCKS - 35:  # D reserved the victim's 35 blocks
                time.sleep(0.02)
            time.sleep(0.3 + 0.2 * attempt)  # P is pushing layers now
        # the client is gone: D frees the victim's blocks, the next request needs them while P may still send
        assert greedy(small_pool, SECOND) == expected
    status = small_pool.status("decode")
    assert status["free_blocks"] == status["total_blocks"]
