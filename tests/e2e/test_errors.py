"""Bad requests get 4xx OpenAI error JSON; a decode worker that died gets a 503 quickly, never a hang."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.launch_plan import free_port
from pdserve.process_group import ProcessGroup, http_ok
from tests.e2e.deployments import MODEL, REPO, SECRET, Deployment


def post(deployment: Deployment, body: str | dict, path: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(f"{deployment.url}{path}", json=body, timeout=30)
    return httpx.post(f"{deployment.url}{path}", content=body, headers={"content-type": "application/json"},
                      timeout=30)


def assert_openai_error(reply: httpx.Response, status: int, *needles: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert {"message", "type", "code"} <= set(error)
    for needle in needles:
        assert needle in error["message"], error["message"]


def test_prompt_too_long_names_both_numbers(disaggregated: Deployment) -> None:
    reply = post(disaggregated, {"model": MODEL, "prompt": [100] * 9000, "max_tokens": 10})
    assert_openai_error(reply, 400, "8192", "9000")


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_must_be_positive(disaggregated: Deployment, max_tokens: int) -> None:
    assert_openai_error(post(disaggregated, {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens}), 400)


def test_unknown_model_malformed_json_and_wrong_types(disaggregated: Deployment) -> None:
    assert_openai_error(post(disaggregated, {"model": "gpt-17", "prompt": "hi"}), 404, "gpt-17")
    assert_openai_error(post(disaggregated, '{"model": "' + MODEL + '", "prompt": "hi",'), 400)
    assert_openai_error(post(disaggregated, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}), 400)
    assert_openai_error(post(disaggregated, {"model": MODEL, "prompt": "hi", "temperature": "hot"}), 400)
    chat = {"model": MODEL, "messages": "not a list"}
    assert_openai_error(post(disaggregated, chat, "/v1/chat/completions"), 400)


def test_official_client_raises_typed_errors(disaggregated: Deployment) -> None:
    api = openai.OpenAI(base_url=f"{disaggregated.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt="hi", max_tokens=0)


def start(args: list[str], log: Path, env: dict[str, str]) -> ProcessGroup:
    return ProcessGroup([sys.executable, "-m", "pdserve.cli", *args], log, env, cwd=REPO).start()


def test_dead_decode_worker_gets_503_within_2_s(disaggregated: Deployment, model_cache_dir: Path,
                                                 tmp_path: Path) -> None:
    """Its own router: the session's P (static) and a D that registers, then is killed with SIGKILL."""
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(model_cache_dir), "PDSERVE_SECRET": SECRET}
    taken: set[int] = set()
    router_port, decode_port = free_port("127.0.0.1", taken), free_port("127.0.0.1", taken)
    router_url = f"http://127.0.0.1:{router_port}"
    router = start(["router", "--port", str(router_port), "--prefill", disaggregated.worker_url("prefill")],
                   tmp_path / "router.log", env)
    decode = start(["decode", "--router", router_url, "--port", str(decode_port), "--num-blocks", "64",
                    "--torch-threads", "1"], tmp_path / "decode.log", env)
    try:
        router.wait_until(lambda: http_ok(f"{router_url}/health"), 120, "router with P and D")
        os.kill(decode.pid, signal.SIGKILL)
        assert decode.popen is not None
        decode.popen.wait(timeout=10)
        for _ in range(2):  # right away (router still lists D), and once more
            started = time.monotonic()
            reply = httpx.post(f"{router_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
                               timeout=10)
            assert time.monotonic() - started < 2.0
            assert_openai_error(reply, 503)
    finally:
        for process in (decode, router):
            process.kill()
