"""A fresh short prompt prefilled by the decode worker because the prefill pool is short of a worker and busy
(conditional disaggregation keyed on P's backlog, router/decode_reuse.py `busy_choice`) gives the same greedy
text as the same prompt through P, in a real `pdserve serve` deployment (router + 1 P + 1 D, the official openai
client).

    through P     P idle (the router counts 0 prompt tokens in prefill there, under --busy-prefill-backlog 1)
                  and the whole pool up: each prompt alone, P prefills it and sends its KV
    busy-local    P holds three 1,000-token prompts (seconds of forwards on one CPU thread) and is drained by the
                  admin API (it finishes them, takes nothing new: the pool has no P for new work): the same
                  prompts, sent together, are prefilled by D itself (`pdserve_busy_local_prefills` counts each)

`--no-decode-prefix-cache` and `--local-prefill-threshold 0`: D computes every busy-local prompt whole, none of
it from the KV the P runs left there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.deployments import INTERNAL, MODEL, Deployment, launch

ADMIN_TOKEN = "busy-local-e2e-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are",
           "Water boils at a temperature of"]
LONG_PROMPTS = 3  # 1,000 tokens each: P's queue while the short prompts are routed


@pytest.fixture(scope="module")
def busy_local(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
               default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("busy-local", ["--busy-prefill-backlog", "1", "--no-decode-prefix-cache",
                                       "--local-prefill-threshold", "0"],
                        tmp_path_factory.mktemp("busy_local"), model_cache_dir,
                        env={"PDSERVE_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=INTERNAL, timeout=5).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"))


def busy_counts(deployment: Deployment) -> tuple[float, float]:
    """(the router's busy-local prefills, the decode worker's local prefills)."""
    return (counter(deployment.url, "pdserve_busy_local_prefills_total"),
            counter(deployment.worker_url("decode"), "pdserve_decode_local_prefills_total"))


def wait_until_p_holds_a_long_prompt(deployment: Deployment) -> None:
    deadline = time.monotonic() + 60
    while deployment.status("prefill")["queue_len"] < 1:
        assert time.monotonic() < deadline, "the long prompts never reached the prefill worker"
        time.sleep(0.02)


async def complete(api: openai.AsyncOpenAI, prompt: str | list[int], max_tokens: int = MAX_TOKENS) -> str:
    reply = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    return reply.choices[0].text


async def through_p_then_busy_local(deployment: Deployment) -> tuple[list[str], list[str], list[str]]:
    """Each prompt alone through idle P; then all of them while P works through the long prompts."""
    async with openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as api:
        through_p = [await complete(api, prompt) for prompt in PROMPTS]  # one at a time: P counts 0 before each
        long = [asyncio.create_task(complete(api, [(11 + 13 * i + 37 * j) % 40000 + 100 for j in range(1000)], 4))
                for i in range(LONG_PROMPTS)]
        await asyncio.to_thread(wait_until_p_holds_a_long_prompt, deployment)
        async with httpx.AsyncClient(base_url=deployment.url, headers=ADMIN, timeout=10) as admin:
            (await admin.post("/admin/workers/prefill-0/drain", json={"exit": False})).raise_for_status()
            busy = await asyncio.gather(*(complete(api, prompt) for prompt in PROMPTS))
            (await admin.post("/admin/workers/prefill-0/resume")).raise_for_status()
        return through_p, list(busy), await asyncio.gather(*long)


def test_busy_local_greedy_outputs_equal_the_same_prompts_through_p(busy_local: Deployment) -> None:
    start = busy_counts(busy_local)
    through_p, busy, long = asyncio.run(through_p_then_busy_local(busy_local))
    router_busy, decode_local = (b - a for a, b in zip(start, busy_counts(busy_local), strict=True))
    assert router_busy == len(PROMPTS) and decode_local == len(PROMPTS)  # none of the P runs went local
    assert busy == through_p
    assert all(text for text in through_p) and len(long) == LONG_PROMPTS
    status = busy_local.status("decode")
    assert status["free_blocks"] == status["total_blocks"], status
