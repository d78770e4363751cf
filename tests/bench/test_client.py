from __future__ import annotations

import time

import httpx
import pytest

from pdserve.bench.client import ApiTarget, send_request


async def _send(server, endpoint: str, prompt, max_tokens: int):
    target = ApiTarget(server.url, endpoint, model="fake-model", ignore_eos=True)
    async with httpx.AsyncClient(timeout=30) as http:
        return await send_request(http, target, prompt, max_tokens, prompt_len=5, t0=time.perf_counter())


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_timings_match_the_server_delays(fake_server, endpoint: str) -> None:
    out = await _send(fake_server, endpoint, "hello", 12)
    assert out.success, out.error
    assert out.output_len == 12 and out.server_prompt_tokens == 7 and out.prompt_len == 5
    assert out.generated_text == "".join(f" w{i}" for i in range(12))
    assert len(out.itl) == 11
    assert fake_server.ttft_s <= out.ttft < fake_server.ttft_s + 0.1
    assert sum(out.itl) >= 11 * fake_server.itl_s * 0.9
    assert out.latency >= out.ttft + sum(out.itl) - 1e-6
    body = fake_server.requests[-1]
    assert body["stream"] and body["max_tokens"] == 12 and body["ignore_eos"] and body["model"] == "fake-model"
    assert ("messages" in body) == endpoint.endswith("chat/completions")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_an_eos_only_answer_completed(fake_server, endpoint: str) -> None:
    """As `vllm bench serve` counts it: 200, a finish_reason, no text, 0 or 1 output tokens."""
    out = await _send(fake_server, endpoint, "answer with EOS", 8)
    assert out.success, out.error
    assert out.generated_text == "" and out.output_len == 1 and out.itl == ()
    assert fake_server.ttft_s <= out.ttft <= out.latency
    silent = await _send(fake_server, endpoint, "SILENT please", 8)
    assert not silent.success and silent.error == "the stream ended without any text or finish_reason"


async def test_http_errors_are_recorded_not_raised(fake_server) -> None:
    out = await _send(fake_server, "/v1/completions", "please FAIL", 4)
    assert not out.success and "HTTP 500" in out.error and "asked to fail" in out.error


async def test_unreachable_server_is_an_error() -> None:
    target = ApiTarget("http://127.0.0.1:9", "/v1/completions")
    async with httpx.AsyncClient(timeout=5) as http:
        out = await send_request(http, target, "x", 4, 1, time.perf_counter())
    assert not out.success and "Connect" in out.error


def test_endpoint_is_checked() -> None:
    with pytest.raises(ValueError, match="/v1/embeddings"):
        ApiTarget("http://x", "/v1/embeddings")
