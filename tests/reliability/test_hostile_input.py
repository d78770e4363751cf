"""Hostile input on real processes: schemathesis against the router's OpenAI schema finds no 5xx; huge bodies,
invalid UTF-8, wrong types and NaN/inf get 4xx (unknown fields are ignored, as vLLM does); malformed and
oversized frames on a decode worker's KV transfer port drop the connection without a large allocation."""

from __future__ import annotations

import collections
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest

from pdserve.kv_transfer.wire import auth_mac
from tests.reliability.cluster import AUTH, MODEL, SECRET, Cluster, Proc, rss_mb, wait_until
from tests.reliability.raw_wire import frame, read_frame

FUZZ_EXAMPLES = 20  # per operation and generation mode: ~80 requests, well under a minute
BIG = 33 << 20  # past the router's default --max-body-size of 32 MiB


@pytest.fixture(scope="module")
def fuzz_router(cluster: Cluster) -> Iterator[Proc]:
    """A router of its own over the session's workers (static), with a 48-token context so that whatever
    schemathesis generates stays cheap to serve."""
    prefill, decode = cluster.live("prefill")[0], cluster.live("decode")[0]
    router = cluster.spawn_router("fuzz-router", "--max-model-len", "48", "--prefill", prefill.url,
                                  "--decode", decode.url)
    try:
        wait_until(lambda: _status(f"{router.url}/health") == 200, 120, "the fuzz router sees its workers")
        yield router
    finally:
        router.kill()


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_schemathesis_finds_no_server_error(fuzz_router: Proc) -> None:
    schemathesis = pytest.importorskip("schemathesis")  # the dev extra; hypothesis comes with it
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(f"{fuzz_router.url}/openapi.json").include(path_regex="^/v1/")
    statuses: collections.Counter[int] = collections.Counter()
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case) -> None:
                response = case.call(base_url=fuzz_router.url, headers=AUTH, timeout=60)
                statuses[response.status_code] += 1
                assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text[:300]}"

            try:
                call()
            except Unsatisfiable:  # nothing to make negative (GET /v1/models has no parameter)
                continue
    seconds = time.monotonic() - started
    assert sum(statuses.values()) >= 2 * FUZZ_EXAMPLES  # bounded by FUZZ_EXAMPLES: ~30 s on 2 busy cores
    print(f"\nRELIABILITY schemathesis: {sum(statuses.values())} generated requests on /v1/* in {seconds:.1f} s, "
          f"statuses {dict(sorted(statuses.items()))}, no 5xx")


def _post(url: str, content: bytes | Iterator[bytes], **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=content, timeout=60,
                      headers={**AUTH, "content-type": "application/json", **headers})


def test_bad_bodies_get_4xx(cluster: Cluster) -> None:
    url = cluster.url
    huge = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * BIG + b'"}'
    assert _post(url, huge).status_code == 413

    def chunks() -> Iterator[bytes]:  # the same without a Content-Length: stopped as it is read
        for start in range(0, len(huge), 1 << 20):
            yield huge[start:start + (1 << 20)]

    assert _post(url, chunks()).status_code == 413
    cases = {
        "invalid UTF-8": b'{"model": "%s", "prompt": "\xc3\x28 \xff"}' % MODEL.encode(),
        "not JSON": b'{"model": ',
        "wrong type": b'{"model": "%s", "prompt": "hi", "max_tokens": "many"}' % MODEL.encode(),
        "NaN": b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(),
        "Infinity": b'{"model": "%s", "prompt": "hi", "top_p": Infinity}' % MODEL.encode(),
        "prompt a number": b'{"model": "%s", "prompt": 12}' % MODEL.encode(),
        "token id out of range": b'{"model": "%s", "prompt": [1, 99999999]}' % MODEL.encode(),
        "array body": b'[1, 2, 3]',
        "100 kB stop string": b'{"model": "%s", "prompt": "hi", "stop": "%s"}' % (MODEL.encode(), b"x" * 100_000),
    }
    surrogates = {  # valid JSON, text no tokenizer can take: each a 400 naming the field, on one connection
        "prompt": b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode(),
        "stop": b'{"model": "%s", "prompt": "hi", "stop": ["\\udfff"]}' % MODEL.encode(),
        "model": b'{"model": "x\\ud800", "prompt": "hi"}',
        "cache_salt": b'{"model": "%s", "prompt": "hi", "cache_salt": "\\ud800"}' % MODEL.encode(),
    }
    for name, body in cases.items():
        reply = _post(url, body)
        assert reply.status_code == 400 and "error" in reply.json(), (name, reply.status_code, reply.text)
    with httpx.Client(base_url=url, headers={**AUTH, "content-type": "application/json"}, timeout=60) as client:
        ports = set()
        for field, body in surrogates.items():
            reply = client.post("/v1/completions", content=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(field), reply.text
            ports.add(reply.extensions["network_stream"].get_extra_info("client_addr")[1])
        assert len(ports) == 1, f"the router closed the connection: {len(ports)} were used"
    unknown = _post(url, b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "frobnicate": {"x": [1]}}'
                    % MODEL.encode())
    assert unknown.status_code == 200, unknown.text  # ignored, as vLLM does
    print(f"\nRELIABILITY bad_bodies: 33 MiB body -> 413 (declared and chunked); {len(cases)} malformed bodies -> "
          f"400; {len(surrogates)} lone surrogates (prompt, stop, model, cache_salt) -> 400 naming the field, all on "
          f"one keep-alive connection; an unknown field is ignored (200)")


# ---- the KV transfer port -----------------------------------------------------------------------------


def _dropped(sock: socket.socket) -> bool:
    """The peer closed the connection (an error frame may come first)."""
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _connect(proc: Proc, authenticate: bool) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proc.transfer_port), timeout=10)
    hello = read_frame(sock)
    assert hello is not None and hello["kind"] == "hello"
    if authenticate:
        sock.sendall(frame({"kind": "auth", "mac": auth_mac(SECRET, hello["nonce"])}))
        assert read_frame(sock)["kind"] == "ready"
    return sock


ATTACKS: dict[str, tuple[bool, bytes]] = {  # name -> (authenticated first, bytes sent)
    "garbage instead of auth": (False, b"\x00\x00\x00\x10" + b"\xde\xad\xbe\xef" * 4),
    "4 GiB header length": (True, b"\xff\xff\xff\xff"),
    "header not a map": (True, struct.pack(">I", 3) + msgpack.packb([1, 2])),
    "1 TiB kv payload": (True, frame({"kind": "kv", "request_id": "nobody", "layer": 0, "block_ids": [0],
                                       "dtype": "float32", "shape": [2, 1, 16, 3, 64], "nbytes": 1 << 40,
                                       "checksum": 0})),
    "kv for a block never reserved": (True, frame({"kind": "kv", "request_id": "nobody", "layer": 0,
                                                    "block_ids": [0], "dtype": "float32", "shape": [2, 1, 16, 3, 64],
                                                    "nbytes": 2 * 16 * 3 * 64 * 4, "checksum": 0})),
    "wrong field types": (True, frame({"kind": "done", "request_id": 7, "first_token_id": "x",
                                        "first_logprob": None, "num_tokens": 1})),
}


def test_malformed_transfer_frames_drop_the_connection_and_allocate_nothing(cluster: Cluster) -> None:
    decode = cluster.live("decode")[0]
    before = rss_mb(decode.pid)
    for name, (authenticate, payload) in ATTACKS.items():
        sock = _connect(decode, authenticate)
        try:
            sock.sendall(payload)
            assert _dropped(sock), name
        finally:
            sock.close()
    grown = rss_mb(decode.pid) - before
    assert grown < 16, f"the decode worker grew by {grown:.1f} MB"
    reply = httpx.post(f"{cluster.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "Still serving?", "max_tokens": 4})
    assert reply.status_code == 200
    cluster.wait_idle()
    print(f"\nRELIABILITY transfer_port: {len(ATTACKS)} malformed or oversized frames each dropped the "
          f"connection; the decode worker's RSS changed by {grown:+.1f} MB and it kept serving")
