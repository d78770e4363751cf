"""`pdserve serve --kv-cache-dtype fp8` end to end: router + 1 P + 1 D over tcp, both pools float8_e4m3fn.

    greedy      short prompts and one of two prefill chunks give the offline engine's text with an fp8 KV cache
                (LLM(kv_cache_dtype="fp8")): P quantizes, the fp8 bytes cross tcp as they are, D reads them;
                D's pool is back to its free count afterwards
    refused     P refuses a target that is not its own KV: D's real reservation with the dtype of a bf16/fp32
                decode worker (the layout check), and with D's dtype but another compatibility key (as a D with
                other fp8 scales or weights would send: the key check), each a 400 naming why
                D's key is the offline engine's fp8 key (the same rule, the same scales: 1.0)
    calculated  `--calculate-kv-scales`: P and D each compute the scales from the built-in text at start; D's key
                is the offline engine's with the same flag (so P's too: it took D's targets), not scale 1.0's,
                and the text is that engine's

--local-prefill-threshold 0: every prompt's KV goes through P and the tcp transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.protocol.connection import Connection, connect
from pdserve.protocol.framing import FrameLimits
from pdserve.protocol.messages import Abort, Prefill, PrefillFailed, Reserve, Reserved
from tests.e2e.deployments import MODEL, SECRET, Deployment, launch

MAX_TOKENS = 16
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]
BUDGET = 504  # with a 600-token prompt: two prefill chunks, the first ending on a block edge (496)
LONG = " ".join(f"Entry {i}: the {i * 7 % 13}th lamp is left of the {i * 5 % 11}th door." for i in range(32))
FLAGS = ["--kv-cache-dtype", "fp8", "--transfer-backend", "tcp", "--local-prefill-threshold", "0",
         "--max-num-batched-tokens", str(BUDGET)]
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def fp8_deployment(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
                   default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("fp8kv", FLAGS, tmp_path_factory.mktemp("fp8kv"), model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


@pytest.fixture(scope="module")
def fp8_llm(model_cache_dir: Path, default_model_dir: Path):
    from pdserve.llm import LLM

    # P's first chunk of the long prompt ends on a block edge (496), so does the offline engine's
    return LLM(MODEL, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=BUDGET, chunk_size=496,
               cache_dir=model_cache_dir, progress=False, kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def calculated_deployment(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path,
                          default_model_dir: Path) -> Iterator[Deployment]:
    deployment = launch("fp8calc", [*FLAGS, "--calculate-kv-scales"], tmp_path_factory.mktemp("fp8calc"),
                        model_cache_dir)
    try:
        yield deployment.wait_ready()
    finally:
        deployment.kill_everything()


def _offline_texts(llm, prompts: list[str]) -> list[str]:
    """One prompt at a time on one torch thread, as the deployment's workers (--torch-threads 1) serve them: an fp8
    cache turns the last-bit differences of a GEMM split over 2 threads, or batched with other prompts, into whole
    e4m3 steps of a K/V value, enough to flip a greedy near-tie ("def fibonacci(n):" at token 12: "return n * fib"
    on one thread, "return max(fib" on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        return [llm.generate([prompt], params)[0].text for prompt in prompts]
    finally:
        torch.set_num_threads(threads)


def test_fp8_kv_over_tcp_gives_the_offline_fp8_text(fp8_deployment: Deployment, fp8_llm) -> None:
    free_before = fp8_deployment.status("decode")["free_blocks"]
    client = openai.OpenAI(base_url=f"{fp8_deployment.url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [*PROMPTS, LONG]
    for prompt, want in zip(prompts, _offline_texts(fp8_llm, prompts), strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want, prompt[:40]
    assert len(fp8_llm.tokenizer.encode(LONG)) > BUDGET  # the long prompt really took two chunks
    deadline = time.monotonic() + 10
    while fp8_deployment.status("decode")["free_blocks"] != free_before:
        assert time.monotonic() < deadline, "D's blocks were not all freed"
        time.sleep(0.1)


async def _link(deployment: Deployment, role: str) -> Connection:
    host, port = deployment.data_address(role)
    connection, _ = await connect(host, port, SECRET, "e2e-test", FrameLimits())
    return connection


async def _refusal(deployment: Deployment, request_id: str, change: dict, key: str) -> PrefillFailed:
    decode, prefill = await _link(deployment, "decode"), await _link(deployment, "prefill")
    prompt = list(range(1000, 1040))
    decode.send(Reserve(request_id, prompt, GREEDY, None, time.time()))
    reserved = await asyncio.wait_for(decode.recv(), 10)
    assert isinstance(reserved, Reserved), reserved
    assert reserved.transfer["dtype"] == "float8_e4m3fn" and reserved.transfer["kv_fingerprint"] == key
    prefill.send(Prefill(request_id, prompt, GREEDY, None, {**reserved.transfer, **change}))
    reply = await asyncio.wait_for(prefill.recv(), 10)
    decode.send(Abort(request_id, "test"))
    decode.close()
    prefill.close()
    assert isinstance(reply, PrefillFailed), reply
    return reply


async def test_prefill_refuses_a_decode_worker_of_another_kv_dtype(fp8_deployment: Deployment, fp8_llm) -> None:
    status = fp8_deployment.status("prefill")
    key = fp8_llm.fingerprint
    reply = await _refusal(fp8_deployment, "other-dtype", {"dtype": "float32", "kv_fingerprint": "f" * 32}, key)
    assert reply.status == 400 and "float32" in reply.message and "float8_e4m3fn" in reply.message, reply
    reply = await _refusal(fp8_deployment, "other-scales", {"kv_fingerprint": "0" * 32}, key)
    assert reply.status == 400 and "compatibility key" in reply.message, reply
    assert fp8_deployment.status("prefill")["free_blocks"] == status["free_blocks"]  # nothing computed or held


async def _decode_key(deployment: Deployment) -> str:
    """The KV compatibility key D puts in a real reservation's transfer target (then the reservation is aborted)."""
    decode = await _link(deployment, "decode")
    decode.send(Reserve("key-probe", list(range(1000, 1040)), GREEDY, None, time.time()))
    reserved = await asyncio.wait_for(decode.recv(), 10)
    decode.send(Abort("key-probe", "test"))
    decode.close()
    assert isinstance(reserved, Reserved), reserved
    return str(reserved.transfer["kv_fingerprint"])


async def test_calculated_kv_scales_agree_across_p_d_and_the_offline_engine(calculated_deployment: Deployment,
                                                                            fp8_llm, model_cache_dir: Path) -> None:
    from pdserve.llm import LLM

    offline = LLM(MODEL, num_blocks=64, max_num_seqs=1, cache_dir=model_cache_dir, progress=False,
                  kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert set(offline.runner.kv_spec.k_scales) != {1.0}
    key = await _decode_key(calculated_deployment)
    assert key == offline.fingerprint and key != fp8_llm.fingerprint
    client = openai.OpenAI(base_url=f"{calculated_deployment.url}/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt, want in zip(PROMPTS, _offline_texts(offline, PROMPTS), strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want, prompt  # P took D's targets: its key is D's, so its scales are too
