"""The decode engine with the real model: its step thread, frames on asyncio queues, preemption by recompute.

P is played in-process by a plain `runner.prefill` into the reserved blocks (what the `local` transfer does),
then `kv_complete` hands the first token over; the outputs must equal the offline engine's even though the
pool is too small for all requests at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak, blocks_needed
from pdserve.decode_node.engine import DecodeEngine
from pdserve.engine.output import OutputProcessor
from pdserve.decode_node.request import DecodeRequest
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams, SamplingRequest
from pdserve.llm import LLM

BLOCK_SIZE = 8
PROMPTS = ["The capital of France is", "A list of fruits: apple,", "Hello, my name is", "In 1492, Columbus"]


@pytest.fixture(scope="module")
def offline(loaded_default, model_cache_dir):
    return LLM(num_blocks=64, max_num_seqs=8, cache_dir=model_cache_dir, progress=False)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread: with other processes busy on a 2-core machine, the offline reference took
    1.3-19.6 s on two threads (spinning threads contend) and a steady 2.5 s on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


async def test_preemption_keeps_outputs_and_frees_every_block(loaded_default, offline, one_thread) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS]
    expected = [o.text for o in offline.generate(prompts, params)]
    # each request grows to 5-6 + 20 tokens = 4 blocks of 8: 4 requests need 16 blocks, the pool has 10
    config = loaded_default.config
    runner = ModelRunner(config, CacheConfig(num_blocks=10, block_size=BLOCK_SIZE), loaded_default.weights, "cpu",
                         torch.float32, max_num_seqs=4)
    pool = BlockPool(10)
    scheduler = Scheduler(pool, BLOCK_SIZE, OutputProcessor(config.eos_token_ids, config.max_model_len), 4,
                          watermark_blocks=0)
    engine = DecodeEngine(scheduler, runner, Sampler(), threading.RLock(), threading.Lock())
    engine.start(asyncio.get_running_loop())
    try:
        for i, prompt in enumerate(prompts):
            request = DecodeRequest(f"r{i}", prompt, params, IncrementalDetokenizer(offline.tokenizer, prompt),
                                    StopChecker(()))
            assert scheduler.reserve(request) is None
            engine.open_queue(request.request_id)
            first = play_prefill(runner, request)
            engine.kv_complete(request.request_id, first, None)
        texts = await asyncio.wait_for(asyncio.gather(*(read_text(engine, f"r{i}") for i in range(4))), 120)
    finally:
        engine.stop()
    assert texts == expected
    assert scheduler.num_preemptions > 0 and engine.stats.num_recomputed_tokens > 0
    assert_no_leak(pool)
    stats = engine.stats  # every step's time is charged to one of its phases; the forwards used the CPU
    assert stats.num_steps > 0 and stats.phase_seconds["forward"] > 0 and stats.forward_cpu_seconds > 0
    assert sum(stats.phase_seconds.values()) == pytest.approx(stats.step_seconds, rel=1e-6)


def play_prefill(runner: ModelRunner, request: DecodeRequest) -> int:
    """Compute the prompt's KV into the reserved blocks and pick the first token greedily."""
    table = request.block_ids[: blocks_needed(len(request.prompt_token_ids), BLOCK_SIZE)]
    output = runner.prefill([PrefillChunk(request.prompt_token_ids, 0, table)])
    return Sampler()(output.logits, [SamplingRequest(request.sampling, request.prompt_token_ids)]).token_ids[0]


async def read_text(engine: DecodeEngine, request_id: str) -> str:
    queue = engine.streams[request_id]
    text = ""
    while True:
        frame = await queue.get()
        text += frame.text
        if frame.finish_reason is not None:
            assert frame.finish_reason == "length", frame
            return text
