"""The request life against workers: retries, failures, client disconnects (FAKE workers, real HTTP)."""

from __future__ import annotations

import json
import socket
import statistics
import time
from pathlib import Path

import httpx
import openai
import pytest
from fake_workers import expected_text, token_text

MODEL = "smollm2-135m-instruct"


def _complete(cluster, **body) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", **body}, timeout=10)


def test_full_decode_worker_is_skipped(make_cluster) -> None:
    cluster = make_cluster(num_decode=2)
    full, spare = _by_url(cluster.decode, cluster.decode_servers)  # both idle: least_kv tries the first id
    full.full = True
    out = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].text == expected_text(None, 2)
    assert full.refused == 1 and full.reserved == [] and len(spare.reserved) == 1
    metrics = httpx.get(f"{cluster.url}/metrics").text
    assert 'pdserve_retries_total{reason="decode_full"} 1.0' in metrics


def test_failed_prefill_is_retried_on_another_prefill_worker(make_cluster) -> None:
    cluster = make_cluster(num_prefill=2)
    broken, healthy = _by_url(cluster.prefill, cluster.prefill_servers)  # round_robin starts at the first id
    broken.fail = True
    out = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].text == expected_text(None, 2)
    first, retry = cluster.decode[0].reserved
    assert retry == f"{first}-retry1"
    assert broken.prefilled == [first] and healthy.prefilled == [retry]
    # the first attempt was freed on D; P, which reported its own failure, holds nothing to abort
    _wait_for(lambda: cluster.decode[0].aborted == [first])  # ABORTs are queued, not awaited
    assert broken.aborted == []


def test_prefill_failing_twice_is_503_and_frees_decode(make_cluster) -> None:
    cluster = make_cluster(num_prefill=1)
    cluster.prefill[0].fail = True
    response = _complete(cluster, max_tokens=2)
    assert response.status_code == 503 and "retry-after" in response.headers
    assert "prefill crashed" in response.json()["error"]["message"]
    _wait_for(lambda: cluster.decode[0].aborted == cluster.decode[0].reserved)  # nothing left reserved on D


def test_client_disconnect_mid_stream_aborts_on_the_decode_worker(make_cluster) -> None:
    cluster = make_cluster()
    decode = cluster.decode[0]
    decode.token_delay_s = 0.02
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ") and next(lines) == "" and next(lines).startswith("data: ")
    assert decode.stream_closed.wait(2), "the router did not abort on D after the client left"
    assert decode.closed_early == decode.reserved == decode.aborted and decode.finished == []
    _wait_for(lambda: 'pdserve_requests_total{status="499"} 1.0' in httpx.get(f"{cluster.url}/metrics").text)


def test_client_timeout_on_non_streaming_request_aborts_on_the_decode_worker(make_cluster) -> None:
    cluster = make_cluster()
    decode = cluster.decode[0]
    decode.token_delay_s = 0.02
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1000},
                   timeout=0.5)
    assert decode.stream_closed.wait(2)
    assert decode.closed_early == decode.reserved and decode.finished == []


@pytest.mark.parametrize("static", [True, False])
def test_decode_worker_gone_is_503_within_2_s(make_cluster, static: bool) -> None:
    cluster = make_cluster(static=static)
    if not static:
        _register(cluster, cluster.prefill[0], cluster.prefill_servers[0].url, "prefill")
        _register(cluster, cluster.decode[0], cluster.decode_servers[0].url, "decode")
    assert _complete(cluster, max_tokens=1).status_code == 200
    cluster.decode_servers[0].stop()
    start = time.monotonic()
    response = _complete(cluster, max_tokens=1)
    assert time.monotonic() - start < 2
    assert response.status_code == 503 and "no decode worker" in response.json()["error"]["message"]
    assert response.headers["retry-after"]


@pytest.mark.parametrize("stream", [False, True])
def test_decode_connection_breaking_mid_way_is_an_error_not_a_hang(make_cluster, stream: bool) -> None:
    cluster = make_cluster()
    cluster.decode[0].break_after = 2
    if not stream:
        response = _complete(cluster, max_tokens=5)
        assert response.status_code == 502
        assert "decode worker" in response.json()["error"]["message"]
        assert "lost" in response.json()["error"]["message"]
        return
    chunks = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="lost"):
        for chunk in chunks:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == expected_text(None, 2)  # what came before the break reached the client


def test_first_token_from_the_prefill_worker_when_it_answers_first(make_cluster) -> None:
    """P's PREFILLED arrives 50 ms before D has the token: the client gets it from P, and D's copy of the
    same token is dropped (the text is whole, no token twice)."""
    cluster = make_cluster()
    cluster.prefill[0].answer_first = True
    out = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, seed=3)
    assert out.choices[0].text == expected_text(3, 4) and out.usage.completion_tokens == 4
    chunks = cluster.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, seed=3, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected_text(3, 4)


@pytest.mark.parametrize("stream", [False, True])
def test_usage_has_p_cached_tokens_when_d_finishes_before_p_answers(make_cluster, stream: bool) -> None:
    """A one-token completion: D ends it as soon as the KV landed, 0.3 s before P's PREFILLED carries the
    prompt tokens P found cached; the usage still counts them (D cannot: it got them as KV)."""
    cluster = make_cluster()
    cluster.prefill[0].answer_after_s = 0.3
    cluster.prefill[0].cached_tokens = 16
    client = cluster.client()
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, seed=3, stream=True,
                                                stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(3, 1)
    else:
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, seed=3)
        usage = out.usage
        assert out.choices[0].text == expected_text(3, 1)
    assert usage.prompt_tokens_details.cached_tokens == 16 and usage.completion_tokens == 1


def test_n_is_all_or_nothing(make_cluster) -> None:
    cluster = make_cluster()
    cluster.prefill[0].fail = True
    assert _complete(cluster, max_tokens=1, n=3).status_code == 503
    decode = cluster.decode[0]
    # the retries find no other P, so each short prompt is offered to D to prefill itself (the busy rule:
    # router/decode_reuse.py busy_choice); this fake D reserves without prefilling, and with no P to fall
    # back on each retry ends in 503 too: 3 first tries + 3 retries, every one aborted
    assert len(decode.reserved) == 6
    assert sum(r.endswith("-retry1") for r in decode.reserved) == 3
    _wait_for(lambda: sorted(decode.aborted) == sorted(decode.reserved))


def test_relay_hands_on_every_stamped_frame_in_order(make_cluster) -> None:
    """D stamps its send time into each frame's text; all 200 reach the client in order, each after it was
    sent. The delay is printed, not asserted: the router's added latency is a benchmark's figure
    (benchmarks/serving_cpu.py, relay case), since a shared 2-core machine makes timed assertions flaky."""
    cluster = make_cluster()
    decode = cluster.decode[0]
    decode.stamp_times, decode.token_delay_s = True, 0.005
    sent, delays = [], []
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrival = time.perf_counter()
                sent.append(float(json.loads(line[6:])["choices"][0]["text"].rstrip(";")))
                delays.append(arrival - sent[-1])
    assert len(sent) == 200
    assert sent == sorted(sent)
    assert min(delays) > 0
    print(f"relay through the router in this process: p50 {statistics.median(delays) * 1e3:.2f} ms per frame")


def test_deltas_queued_while_the_client_lags_go_out_merged_with_the_text_intact(make_cluster) -> None:
    """Smooth streams (router/streaming.py): while the client keeps up every token is its own event (the test
    above: 200 stamped frames, none merged); when it stops reading, its socket and the kernel's buffers fill,
    uvicorn's send waits, and the deltas that queue meanwhile go out merged, one event per choice."""
    cluster = make_cluster()
    decode = cluster.decode[0]
    # three times what the kernel's send buffer can grow to (tcp_wmem's maximum), in 1,500 tokens
    send_buffer_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    tokens = 1500
    decode.text_padding = max(4000, 3 * send_buffer_max // tokens)
    decode.token_delay_s = 0.001  # a stream that flows: the router writes the deltas as they come
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": tokens, "stream": True, "seed": 7}
    transport = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)])
    with httpx.Client(transport=transport, timeout=60) as client, \
            client.stream("POST", f"{cluster.url}/v1/completions", json=body) as response:
        _wait_for(lambda: len(decode.finished) == 1, timeout_s=30)  # D has sent every token; nothing read yet
        time.sleep(2.0)  # the router's write waits on the full socket while the rest queue behind it
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    pad = "." * decode.text_padding
    assert "".join(texts) == "".join(f"{token}{pad}" for token in token_texts(7, tokens))
    assert len(texts) <= tokens - 100, len(texts)  # some hundreds of tokens went out as one event
    assert len(texts) > 100  # those written before the socket filled were one event each


def token_texts(seed: int, count: int) -> list[str]:
    return [token_text(seed, i) for i in range(count)]


def _by_url(workers: list, servers: list) -> list:
    """Static workers are named by URL; policies break ties by name."""
    return [w for _, w in sorted(zip((s.url for s in servers), workers, strict=True))]


def _register(cluster, worker, url: str, role: str) -> None:
    body = {"worker_id": worker.worker_id, "url": url, "roles": [role], "model": MODEL, "block_size": 16,
            "num_blocks": 1000, "data_port": worker.data.port}
    assert httpx.post(f"{cluster.url}/internal/workers/register", json=body).status_code == 200


def _wait_for(condition, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_prefill_backlog_count_returns_to_zero(make_cluster) -> None:
    """The busy rule reads each P's `inflight_prompt_tokens` (the router's own count): one left behind by a
    finished, failed or retried attempt would make that P look busy for good, and send every short prompt to D."""
    cluster = make_cluster(num_prefill=2)
    assert _complete(cluster, max_tokens=2, n=2).status_code == 200
    cluster.prefill[0].fail = True
    assert all(_complete(cluster, max_tokens=2, prompt=f"Hi {i}").status_code == 200 for i in range(4))
    prefill = [w for w in cluster.state.registry.workers() if "prefill" in w.roles]
    assert len(prefill) == 2
    _wait_for(lambda: all(w.inflight == 0 and w.inflight_prompt_tokens == 0 for w in prefill))
