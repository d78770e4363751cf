"""Many concurrent streams through the disaggregated deployment; a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai

from tests.e2e.deployments import INTERNAL, MODEL, Deployment

NUM_REQUESTS = 32


def prompt_lengths() -> list[int]:
    """32 distinct lengths from 1 to 1,000 tokens, roughly geometric (5,200 prompt tokens in all)."""
    geometric = {round(1000 ** (i / (NUM_REQUESTS - 1))) for i in range(NUM_REQUESTS)}  # 29 distinct
    return sorted(geometric | {10, 50, 150})


async def stream_one(api: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> dict:
    stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    text, chunks, usage, finish = "", 0, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            chunks += 1
            finish = choice.finish_reason or finish
    return {"text": text, "chunks": chunks, "usage": usage, "finish": finish}


def test_32_concurrent_streams_finish_with_correct_counts(disaggregated: Deployment) -> None:
    rng = random.Random(0)
    lengths = prompt_lengths()
    assert len(lengths) == NUM_REQUESTS and min(lengths) == 1 and max(lengths) == 1000
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    max_tokens = [4 + i % 5 for i in range(NUM_REQUESTS)]
    free_before = {role: disaggregated.status(role)["free_blocks"] for role in ("prefill", "decode")}

    async def run() -> tuple[list[dict], float]:
        async with openai.AsyncOpenAI(base_url=f"{disaggregated.url}/v1", api_key="unused", max_retries=0,
                                      timeout=180) as api:
            streams = asyncio.gather(*(stream_one(api, p, m) for p, m in zip(prompts, max_tokens, strict=True)))
            slowest = asyncio.create_task(slowest_status(disaggregated, streams))
            return await streams, await slowest

    results, slowest = asyncio.run(run())
    assert slowest < 2.0, f"a worker took {slowest:.2f} s to answer /internal/status while busy"  # 0.16 s seen
    for prompt, wanted, result in zip(prompts, max_tokens, results, strict=True):
        assert result["finish"] == "length", result
        assert result["usage"].prompt_tokens == len(prompt)
        assert result["usage"].completion_tokens == wanted
        assert result["usage"].total_tokens == len(prompt) + wanted
    assert wait_for_free_blocks(disaggregated, free_before) == free_before


def test_client_disconnect_frees_blocks_on_both_workers(deployment: Deployment) -> None:
    """Gone mid-stream (D is decoding), and gone at once (D is still waiting for the KV of a long prompt)."""
    free_before = {role: deployment.status(role)["free_blocks"] for role in ("prefill", "decode")}

    async def run() -> int:
        async with openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0,
                                      timeout=60) as api:
            stream = await api.completions.create(model=MODEL, prompt="Tell me a long story about a dragon.",
                                                  max_tokens=2000, temperature=0.0, stream=True,
                                                  extra_body={"ignore_eos": True})
            received = 0
            async for _ in stream:
                received += 1
                if received == 3:
                    break
            busy = deployment.status("decode")["free_blocks"]
            await stream.close()
            early = await api.completions.create(model=MODEL, prompt=list(range(1000, 1400)), max_tokens=50,
                                                 stream=True)
            await early.close()
            return busy

    assert asyncio.run(run()) < free_before["decode"]  # the first request held blocks while streaming
    assert wait_for_free_blocks(deployment, free_before) == free_before


async def slowest_status(deployment: Deployment, busy: asyncio.Future) -> float:
    """Longest answer time of P's and D's /internal/status, polled while `busy` runs: the forwards run on
    their own threads, so the event loops keep answering."""
    slowest = 0.0
    async with httpx.AsyncClient(headers=INTERNAL, timeout=30) as client:
        while not busy.done():
            for role in ("prefill", "decode"):
                started = time.perf_counter()
                await client.get(f"{deployment.worker_url(role)}/internal/status")
                slowest = max(slowest, time.perf_counter() - started)
            await asyncio.sleep(0.1)
    return slowest


def wait_for_free_blocks(deployment: Deployment, expected: dict[str, int], timeout_s: float = 30.0) -> dict:
    """Free block counts of P and D, polled until they are back to `expected` (or the timeout: a prefill that
    was aborted inside its forward frees its blocks when the forward ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = {role: deployment.status(role)["free_blocks"] for role in expected}
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.1)
