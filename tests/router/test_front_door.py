"""The router's front door (router/front_door.py): API key, body size limit, in-flight limit, NaN/inf and
invalid UTF-8, each answered with OpenAI-style JSON and a 4xx status, never a 5xx."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    if code is not None:
        assert error["code"] == code
    return error


def test_api_key_guards_v1_only(make_cluster) -> None:
    cluster = make_cluster(api_key="sk-test-123")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{cluster.url}/v1/completions", json=body).status_code == 401
    wrong = httpx.get(f"{cluster.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert _error(wrong, 401, "invalid_api_key") and wrong.headers["www-authenticate"] == "Bearer"
    good = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test-123", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    for path in ("/health", "/metrics", "/status.json"):  # read-only service routes stay open, as in vLLM
        assert httpx.get(f"{cluster.url}{path}").status_code == 200, path
    metrics = httpx.get(f"{cluster.url}/metrics").text
    assert 'pdserve_requests_total{status="401"} 3.0' in metrics


def test_body_size_limit_answers_413_declared_or_streamed(make_cluster) -> None:
    cluster = make_cluster(max_body_bytes=1024)
    big = b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"a" * 2000)
    declared = httpx.post(f"{cluster.url}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert f"({len(big)} bytes)" in _error(declared, 413, "request_too_large")["message"]

    def chunks():  # no Content-Length: the router counts as it reads
        for start in range(0, len(big), 256):
            yield big[start:start + 256]

    streamed = httpx.post(f"{cluster.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "1024 bytes" in _error(streamed, 413)["message"]
    small = httpx.post(f"{cluster.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert small.status_code == 200


def test_nan_inf_and_invalid_utf8_are_400(cluster) -> None:
    url = f"{cluster.url}/v1/completions"
    headers = {"content-type": "application/json"}
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = f'{{"model": "{MODEL}", "prompt": "Hi", "temperature": {literal}}}'
        _error(httpx.post(url, content=body, headers=headers), 400)
    _error(httpx.post(url, content=b'{"model": "x", "prompt": "\xff\xfe bad"}', headers=headers), 400)
    logit_bias = f'{{"model": "{MODEL}", "prompt": "Hi", "logit_bias": {{"5": NaN}}}}'
    _error(httpx.post(url, content=logit_bias, headers=headers), 400)


async def test_inflight_limit_answers_429_with_retry_after_then_recovers(make_cluster) -> None:
    cluster = make_cluster(max_inflight_requests=2, retry_after_s=3)
    cluster.decode[0].token_delay_s = 0.05
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 12, "stream": True}
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as client:
        async def stream() -> int:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                await response.aread()
                return response.status_code

        holders = [asyncio.create_task(stream()) for _ in range(2)]
        await asyncio.sleep(0.3)  # both are streaming now
        refused = await client.post("/v1/completions", json=body)
        assert refused.headers["retry-after"] == "3"
        _error(refused, 429, "too_many_requests")
        assert await asyncio.gather(*holders) == [200, 200]
        assert (await client.post("/v1/completions", json={**body, "stream": False})).status_code == 200
