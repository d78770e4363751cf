"""Text no tokenizer can take, and what n multiplies, on a real router over HTTP (FAKE workers behind it).

JSON may carry lone UTF-16 surrogates ("\\ud800"); before, one in the prompt, a message, stop, model or
cache_salt was a 500 and the connection was dropped (the client's next keep-alive request failed). Now every
such field is a 400 naming it, and the connection serves the next request: checked field by field on one raw
keep-alive socket, then fuzzed with hypothesis. Stop strings are capped (4, as OpenAI documents; 256 characters
each), and so are n x prompt tokens and n x max_tokens."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.sampling_params import MAX_STOP_CHARS
from tests.router.conftest import cluster_factory

MODEL = "smollm2-135m-instruct"

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD = "ok \ud800 ok"
# (path, field path the error names, body): every text field a client can send
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("/v1/completions", "prompt", {**COMPLETION, "prompt": BAD}),
    ("/v1/completions", "prompt.1", {**COMPLETION, "prompt": ["fine", BAD]}),
    ("/v1/completions", "stop", {**COMPLETION, "stop": BAD}),
    ("/v1/completions", "stop.0", {**COMPLETION, "stop": [BAD]}),
    ("/v1/completions", "model", {**COMPLETION, "model": BAD}),
    ("/v1/completions", "cache_salt", {**COMPLETION, "cache_salt": BAD}),
    ("/v1/completions", "user", {**COMPLETION, "user": BAD}),
    ("/v1/completions", "suffix", {**COMPLETION, "suffix": BAD}),
    ("/v1/completions", "logit_bias", {**COMPLETION, "logit_bias": {BAD: 1.0}}),
    ("/v1/chat/completions", "messages.0.content", {**CHAT, "messages": [{"role": "user", "content": BAD}]}),
    ("/v1/chat/completions", "messages.0.content.1.text",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": BAD}]}]}),
    ("/v1/chat/completions", "messages.1.role", {**CHAT, "messages": [*CHAT["messages"], {"role": BAD, "content": "x"}]}),
    ("/v1/chat/completions", "messages.0.name", {**CHAT, "messages": [{"role": "user", "content": "x", "name": BAD}]}),
    ("/v1/chat/completions", "response_format.type", {**CHAT, "response_format": {"type": BAD}}),
    ("/v1/chat/completions", "stop.1", {**CHAT, "stop": ["x", "\udfff"]}),
]


class KeepAlive:
    """One HTTP/1.1 connection held open across requests: a server that closes it makes the next send fail."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.file = self.sock.makefile("rb")

    def post(self, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.sock.sendall(head + body)
        status = int(self.file.readline().split()[1])
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        assert headers.get("connection") != "close", "the server is closing the connection"
        return status, json.loads(self.file.read(int(headers["content-length"])))

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture
def keep_alive(cluster) -> Iterator[KeepAlive]:
    connection = KeepAlive(cluster.url)
    yield connection
    connection.close()


def ascii_json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as its \\udXXX escape


@pytest.mark.parametrize(("path", "param", "body"), CASES, ids=[case[1] for case in CASES])
def test_text_that_cannot_be_encoded_is_400_naming_the_field_and_the_connection_stays(
        keep_alive: KeepAlive, path: str, param: str, body: dict[str, Any]) -> None:
    status, answer = keep_alive.post(path, ascii_json(body))
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["code"] == "invalid_text", answer
    assert "cannot be encoded as UTF-8" in answer["error"]["message"] and "U+D" in answer["error"]["message"]
    status, answer = keep_alive.post("/v1/completions", ascii_json(COMPLETION))  # same connection
    assert status == 200 and answer["choices"][0]["text"], answer


SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.text(st.characters(codec=None), max_size=12)  # any code point, surrogates and NUL included
FIELDS = ["prompt", "stop", "model", "cache_salt", "user", "content", "role", "name"]


@st.composite
def hostile_text(draw: st.DrawFn) -> str:
    """Text with at least one lone surrogate somewhere in it."""
    before, after = draw(TEXT), draw(TEXT)
    return before + draw(SURROGATES) + after


def _place(field: str, text: str) -> tuple[str, dict[str, Any], str]:
    """(route, body, the field path the error must name) with `text` in `field`."""
    if field in ("content", "role", "name"):
        message = {"role": "user", "content": "x", field: text}
        return "/v1/chat/completions", {**CHAT, "messages": [message]}, f"messages.0.{field}"
    return "/v1/completions", {**COMPLETION, field: text}, field


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), text=hostile_text(), clean=TEXT)
def test_fuzzed_surrogates_anywhere_are_400_and_clean_text_is_never_5xx(keep_alive: KeepAlive, field: str,
                                                                         text: str, clean: str) -> None:
    path, body, param = _place(field, text)
    status, answer = keep_alive.post(path, ascii_json(body))
    assert (status, answer["error"]["param"]) == (400, param), answer
    path, body, _ = _place(field, clean or "x")  # any valid text: answered, whatever the answer is
    status, answer = keep_alive.post(path, ascii_json(body))
    assert status < 500, answer


@pytest.mark.parametrize(("body", "words"), [
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop strings"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, f"at most {MAX_STOP_CHARS} characters"),
    ({"stop": ["ok", "x" * 100_000]}, f"at most {MAX_STOP_CHARS} characters each, got 100000"),
    ({"stop_token_ids": list(range(2000))}, "at most 1024 stop_token_ids"),
])
def test_stop_sequences_are_capped(cluster, body: dict[str, Any], words: str) -> None:
    reply = httpx.post(f"{cluster.url}/v1/completions", json={**COMPLETION, **body}, timeout=10)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["param"] in ("stop", "stop_token_ids")
    ok = httpx.post(f"{cluster.url}/v1/completions", json={**COMPLETION, "stop": ["y" * MAX_STOP_CHARS] * 4})
    assert ok.status_code == 200, ok.text


def test_what_n_multiplies_is_capped(make_cluster) -> None:
    cluster = make_cluster(max_request_prompt_tokens=64, max_request_completion_tokens=40)
    prompt = list(range(100, 116))  # 16 tokens

    def post(**fields: Any) -> httpx.Response:
        return httpx.post(f"{cluster.url}/v1/completions", timeout=10,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields})

    assert post(n=4).status_code == 200  # 64 prompt tokens, 16 completion tokens
    too_many = post(n=5).json()["error"]
    assert too_many["param"] == "n" and "n x prompt tokens is 5 x 16 = 80" in too_many["message"], too_many
    two_prompts = post(prompt=[prompt, prompt], n=3).json()["error"]  # 3 x (16 + 16) = 96
    assert "3 x 32 = 96" in two_prompts["message"], two_prompts
    long = post(n=2, max_tokens=21).json()["error"]
    assert long["param"] == "n" and "n x max_tokens is 2 x 21 = 42" in long["message"], long


class FailingTokenizer:
    """FAKE: the real tokenizer, except that it raises on one text, standing in for a bug in the router."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "boom":
            raise RuntimeError("a bug")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_an_unexpected_error_is_a_500_and_the_connection_stays(tokenizer) -> None:
    with cluster_factory(FailingTokenizer(tokenizer)) as make:
        connection = KeepAlive(make().url)
        try:
            status, answer = connection.post("/v1/completions", ascii_json({**COMPLETION, "prompt": "boom"}))
            assert status == 500 and "RuntimeError: a bug" in answer["error"]["message"], answer
            status, answer = connection.post("/v1/completions", ascii_json(COMPLETION))
            assert status == 200, answer
        finally:
            connection.close()
