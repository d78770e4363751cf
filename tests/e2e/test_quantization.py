"""`pdserve serve --quantization fp8`: router + prefill + decode workers with fp8 linears, through the openai
client; the greedy text is the offline engine's with the same fp8 weights (both run the reference kernels)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from pdserve.engine.sampling import SamplingParams
from tests.e2e.deployments import MODEL, Deployment, launch

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fp8_deployment(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
                   default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("fp8", ["--quantization", "fp8"], tmp_path_factory.mktemp("fp8"), model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        if deployment.process.poll() is None:
            deployment.process.send_signal(signal.SIGTERM)
        try:
            deployment.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        deployment.kill_everything()


async def _complete(deployment: Deployment) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as api:
        # one at a time: per-token activation scales round to fp8, so a last-bit difference of another batch
        # composition can move a code one step and the greedy text with it (concurrent requests did, once)
        return [(await api.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0))
                .choices[0].text for p in PROMPTS]


def test_serve_fp8_answers_as_the_offline_fp8_engine(fp8_deployment: Deployment, model_cache_dir: Path) -> None:
    from pdserve.llm import LLM

    texts = asyncio.run(_complete(fp8_deployment))
    llm = LLM(MODEL, quantization="fp8", num_blocks=64, cache_dir=model_cache_dir, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (--torch-threads 1): fp32 sums split over threads round otherwise,
    try:  # and fp8 activation codes can move a step on such a last-bit difference
        offline = [llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0] for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    assert texts == [o.text for o in offline]
    assert all(t.strip() for t in texts)
    assert fp8_deployment.log().count("(linears: fp8)") == 2  # the loader's line, from P and from D
