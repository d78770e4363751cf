"""The router's console of a real `pdserve serve` (router/console.py), read from the launcher's log file, which
holds its children's output: a line per finished request (streamed, collected, and a client that hung up), and
the 10-second stats lines of both pools with the tokens they moved."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from tests.e2e.deployments import MODEL, Deployment

STATS_INTERVAL_S = 10.0  # the default, as `pdserve serve` runs it
STATS = re.compile(r"(?P<pool>prefill|decode|colocated) pool \((?P<workers>\d+) workers?\): Avg prompt throughput: "
                   r"(?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, Running: "
                   r"(?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs, KV cache usage: (?P<kv>[\d.]+)%, "
                   r"Prefix cache hit rate: (?P<hit>[\d.]+)%")


def _request_line(deployment: Deployment, request_id: str, timeout_s: float = 10.0) -> str:
    """The router's line for `request_id`, waiting for it to be written."""
    pattern = re.compile(rf"pdserve\.router INFO Finished request {re.escape(request_id)}: .*")
    deadline = time.monotonic() + timeout_s
    while not (found := pattern.search(deployment.log_path.read_text(errors="replace"))):
        assert time.monotonic() < deadline, f"no request line for {request_id}:\n{deployment.log()}"
        time.sleep(0.1)
    return found.group(0)


def _client(deployment: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_a_line_per_finished_request(disaggregated: Deployment) -> None:
    client = _client(disaggregated)
    collected = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                          temperature=0)
    usage = collected.usage
    line = _request_line(disaggregated, collected.id)
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    assert re.fullmatch(
        rf".*: 200 {collected.choices[0].finish_reason}, prompt {usage.prompt_tokens} tokens \({cached} cached\), "
        rf"output {usage.completion_tokens} tokens, TTFT \d+\.\d{{3}} s, E2E \d+\.\d\d s", line), line

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    line = _request_line(disaggregated, chunks[0].id)
    assert f"prompt {chunks[-1].usage.prompt_tokens} tokens" in line and ": 200 " in line
    assert f"output {chunks[-1].usage.completion_tokens} tokens" in line


def test_a_client_that_hangs_up_gets_a_499_line(disaggregated: Deployment) -> None:
    body = {"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{disaggregated.url}/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                request_id = json.loads(line.removeprefix("data: "))["id"]
                break  # leave after the first token
    line = _request_line(disaggregated, request_id)
    assert ": 499, " in line and "TTFT -" not in line, line


def test_stats_lines_of_both_pools_while_busy(disaggregated: Deployment) -> None:
    logged_before = len(disaggregated.log_path.read_text(errors="replace"))
    client = _client(disaggregated)
    prompt = "Write a short story about a lighthouse keeper. " * 8

    def ask(i: int) -> None:
        client.completions.create(model=MODEL, prompt=f"{i}. {prompt}", max_tokens=24, temperature=0)

    deadline = time.monotonic() + 3 * STATS_INTERVAL_S  # two lines' worth, and the heartbeat that reports them
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(8)))
    while True:
        new = disaggregated.log_path.read_text(errors="replace")[logged_before:]
        lines = [m for m in STATS.finditer(new)]
        moved = {m["pool"]: m for m in lines if float(m["prompt"]) > 0 or float(m["gen"]) > 0}
        if "prefill" in moved and "decode" in moved:
            break
        assert time.monotonic() < deadline, f"no stats lines of both pools moving tokens:\n{new[-3000:]}"
        time.sleep(0.5)
    assert float(moved["prefill"]["prompt"]) > 0 and moved["prefill"]["workers"] == "1"
    assert float(moved["decode"]["gen"]) > 0 and float(moved["decode"]["prompt"]) == 0
    assert all(0 <= float(m["kv"]) <= 100 and 0 <= float(m["hit"]) <= 100 for m in lines)
