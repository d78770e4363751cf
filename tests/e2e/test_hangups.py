"""Clients that leave early, and connections that idle (issue 16, items 3 and 7), on the session's `pdserve serve`.

A client that hangs up before its first token: the router notices while the request is still starting
(router/app.py `_start` watches for the disconnect), closes the attempt, and ABORT reaches P and D at once:
P's queue and D's reservation are free within 1 s. Idle: the router holds one data-plane connection per
worker (router/worker_link.py), with no pool to go stale; traffic after an idle spell longer than every
keep-alive timeout (uvicorn's 5 s, on the routers' and the workers' HTTP) loses no request.
"""

from __future__ import annotations

import socket
import time

import httpx
import openai

from tests.e2e.deployments import MODEL, Deployment

# three prompts of 300 tokens: one packed prefill forward of ~0.5 s on this CPU (a forward is not cut short:
# an aborted request leaves P when the forward it is in ends; on the H200 a forward takes ~100 ms at most)
PROMPTS = [list(range(1000 + 300 * i, 1300 + 300 * i)) for i in range(3)]


def idle(deployment: Deployment) -> bool:
    prefill, decode = deployment.status("prefill"), deployment.status("decode")
    return prefill["queue_len"] == 0 and decode["free_blocks"] == decode["total_blocks"] \
        and decode["num_waiting"] == 0 and decode["num_running"] == 0


def hang_up_after(deployment: Deployment, bodies: list[bytes], seconds: float) -> None:
    """Send requests on raw sockets and close them all after `seconds`, before any answer came."""
    host, port = deployment.url.removeprefix("http://").split(":")
    sockets = [socket.create_connection((host, int(port))) for _ in bodies]
    for sock, body in zip(sockets, bodies, strict=True):
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(seconds)
    for sock in sockets:
        sock.close()


def test_a_client_gone_before_its_first_token_frees_p_and_d_within_a_second(disaggregated: Deployment) -> None:
    assert idle(disaggregated)
    for stream in (False, True):
        bodies = [httpx.Request("POST", "http://x", json={"model": MODEL, "prompt": p, "max_tokens": 50,
                                                           "stream": stream}).content for p in PROMPTS]
        hang_up_after(disaggregated, bodies, 0.2)  # P is computing the prompts, D holds their reservations
        gone = time.monotonic()
        while not idle(disaggregated):
            assert time.monotonic() - gone < 1.0, (disaggregated.status("prefill"), disaggregated.status("decode"))
            time.sleep(0.05)
        print(f"\nRELIABILITY hang-up (stream={stream}): P and D idle {time.monotonic() - gone:.2f} s after the "
              "client left")


def test_no_request_fails_after_an_idle_spell_past_every_keep_alive(disaggregated: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{disaggregated.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    time.sleep(7.0)  # past uvicorn's 5 s keep-alive on the router's and the workers' HTTP servers
    for i in range(12):
        out = client.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=2)
        assert out.usage.completion_tokens == 2
