"""The decode engine with the real model: its step thread, its deltas, preemption by recompute, and the
overlapped loop (async scheduling) against the synchronous one.

P is played in-process by a plain `runner.prefill` into the reserved blocks (what the `local` transfer does),
then `kv_complete` hands the first token over; the outputs must equal the offline engine's even though the
pool is too small for all requests at once.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak, blocks_needed
from pdserve.decode_node.engine import DecodeEngine
from pdserve.decode_node.request import DecodeRequest
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.output import OutputProcessor
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams, SamplingRequest

BLOCK_SIZE = 8
PROMPTS = ["The capital of France is", "A list of fruits: apple,", "Hello, my name is", "In 1492, Columbus"]


class Deltas:
    """The engine's deltas, per request, on asyncio queues (what decode_node/service.py would send)."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        engine.on_outputs = self.put

    def put(self, outputs) -> None:
        for output in outputs:
            self.queues.setdefault(output.request_id, asyncio.Queue()).put_nowait(output.delta)

    def queue(self, request_id: str) -> asyncio.Queue:
        return self.queues.setdefault(request_id, asyncio.Queue())

    async def text(self, request_id: str) -> tuple[str, str]:
        text = ""
        while True:
            delta = await self.queue(request_id).get()
            text += delta.text
            if delta.finish_reason is not None:
                return text, delta.finish_reason


def build(loaded_default, num_blocks: int, max_num_seqs: int, async_scheduling: bool = True):
    config = loaded_default.config
    runner = ModelRunner(config, CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE), loaded_default.weights,
                         "cpu", torch.float32, max_num_seqs=max_num_seqs)
    pool = BlockPool(num_blocks)
    scheduler = Scheduler(pool, BLOCK_SIZE, OutputProcessor(config.eos_token_ids, config.max_model_len),
                          max_num_seqs, watermark_blocks=0)
    engine = DecodeEngine(scheduler, runner, Sampler(), threading.RLock(), threading.Lock(),
                          async_scheduling=async_scheduling)
    return runner, pool, scheduler, engine


def submit(engine: DecodeEngine, runner: ModelRunner, tokenizer, request_id: str, prompt: list[int],
           params: SamplingParams) -> None:
    request = DecodeRequest(request_id, prompt, params, IncrementalDetokenizer(tokenizer, prompt),
                            StopChecker(params.stop))
    with engine.state_lock:
        assert engine.scheduler.reserve(request) is None
    first = play_prefill(runner, request)
    engine.kv_complete(request_id, first, None)


async def generate(loaded_default, offline, params: list[SamplingParams], async_scheduling: bool,
                   num_blocks: int = 64) -> list[tuple[str, str]]:
    runner, pool, scheduler, engine = build(loaded_default, num_blocks, 4, async_scheduling)
    deltas = Deltas(engine)
    engine.start(asyncio.get_running_loop())
    try:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            submit(engine, runner, offline.tokenizer, f"r{i}", offline.tokenizer.encode(prompt), p)
        out = await asyncio.wait_for(asyncio.gather(*(deltas.text(f"r{i}") for i in range(len(params)))), 120)
    finally:
        engine.stop()
    assert_no_leak(pool)
    assert not scheduler.queues.requests and all(r.num_pending == 0 for r in scheduler.queues.running)
    return list(out)


async def test_preemption_keeps_outputs_and_frees_every_block(loaded_default, offline, one_thread) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS]
    expected = [o.text for o in offline.generate(prompts, params)]
    # each request grows to 5-6 + 20 tokens = 4 blocks of 8: 4 requests need 16 blocks, the pool has 10
    runner, pool, scheduler, engine = build(loaded_default, 10, 4)
    deltas = Deltas(engine)
    engine.start(asyncio.get_running_loop())
    try:
        for i, prompt in enumerate(prompts):
            submit(engine, runner, offline.tokenizer, f"r{i}", prompt, params)
        out = await asyncio.wait_for(asyncio.gather(*(deltas.text(f"r{i}") for i in range(4))), 120)
    finally:
        engine.stop()
    assert [text for text, _ in out] == expected and {reason for _, reason in out} == {"length"}
    assert scheduler.num_preemptions > 0 and engine.stats.num_recomputed_tokens > 0
    assert_no_leak(pool)
    stats = engine.stats  # every step's time is charged to one of its phases; the forwards used the CPU
    assert stats.num_steps > 0 and stats.phase_seconds["launch"] > 0 and stats.forward_cpu_seconds > 0
    assert sum(stats.phase_seconds.values()) == pytest.approx(stats.step_seconds, rel=1e-6)


# greedy rows ending by EOS, by a stop string, by max_tokens; a seeded row; a penalised row (the loop drains)
MIXED = [SamplingParams(max_tokens=40, temperature=0.0),
         SamplingParams(max_tokens=30, temperature=0.0, stop=(" banana",)),
         SamplingParams(max_tokens=7, temperature=0.9, seed=11),
         SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3)]


async def test_async_scheduling_gives_the_outputs_of_the_synchronous_loop(loaded_default, offline, one_thread) -> None:
    overlapped = await generate(loaded_default, offline, MIXED, async_scheduling=True)
    synchronous = await generate(loaded_default, offline, MIXED, async_scheduling=False)
    assert overlapped == synchronous
    prompts = [offline.tokenizer.encode(p) for p in PROMPTS]
    expected = [(o.text, o.finish_reason) for o in offline.generate(prompts, MIXED)]
    assert overlapped == expected


async def test_abort_takes_effect_within_one_step(loaded_default, offline, one_thread) -> None:
    """An abort while steps are in flight: no token reaches the request after it, its blocks come back."""
    runner, pool, _scheduler, engine = build(loaded_default, 64, 4)
    deltas = Deltas(engine)
    engine.start(asyncio.get_running_loop())
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    try:
        submit(engine, runner, offline.tokenizer, "a", offline.tokenizer.encode(PROMPTS[0]), params)
        queue = deltas.queue("a")
        for _ in range(3):
            assert (await asyncio.wait_for(queue.get(), 30)).token_ids
        engine.abort("a", "test")
        while True:
            delta = await asyncio.wait_for(queue.get(), 30)
            if delta.finish_reason is not None:
                break
            assert delta.token_ids  # tokens published before the abort may still be queued for the loop
        assert delta.finish_reason == "abort" and delta.token_ids == []
        await asyncio.sleep(0.2)
    finally:
        engine.stop()
    assert queue.empty()
    assert_no_leak(pool)


def play_prefill(runner: ModelRunner, request: DecodeRequest) -> int:
    """Compute the prompt's KV into the reserved blocks and pick the first token greedily."""
    table = request.block_ids[: blocks_needed(len(request.prompt_token_ids), BLOCK_SIZE)]
    output = runner.prefill([PrefillChunk(request.prompt_token_ids, 0, table)])
    return Sampler()(output.logits, [SamplingRequest(request.sampling, request.prompt_token_ids)]).token_ids[0]
