"""The overlapped decode loop on a GPU (skipped elsewhere): CUDA graphs, the carried ids read on the device,
the pinned double-buffered staging and the deferred host copy of the draws.

Exact: greedy and seeded rows ending by max_tokens (known ahead, so both loops run the same batches, as
requests finish across graph buckets) give the synchronous loop's token ids. Rows whose batch differs between
the loops (a stop token ends a request one step after the overlapped loop launched its next row; a penalised
row makes it drain) run through other kernel configs of bf16 GEMMs, so they are only checked to finish and to
leave no block behind."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak, blocks_needed
from pdserve.decode_node.engine import DecodeEngine, DecodeStats
from pdserve.decode_node.request import DecodeRequest
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.output import NoTextDecoder, OutputProcessor
from pdserve.engine.presets import get_preset
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams, SamplingRequest
from pdserve.engine.weights.dummy import dummy_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the overlapped loop on CUDA needs a GPU")
BLOCK = 16
NUM_REQUESTS = 37  # crosses the 32 and 40 buckets as requests finish


def exact(i: int) -> SamplingParams:
    return [SamplingParams(max_tokens=24 + i % 7, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=20 + i % 5, temperature=0.8, seed=i, ignore_eos=True)][i % 2]


def mixed(i: int) -> SamplingParams:
    return [exact(i), SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.2, ignore_eos=True),
            SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=tuple(range(i, 49152, 97)),
                           ignore_eos=True)][i % 3]


async def run(runner: ModelRunner, async_scheduling: bool, params=exact,
              stats: list[DecodeStats] | None = None) -> list[list[int]]:
    config = runner.config
    pool = BlockPool(runner.cache_config.num_blocks)
    scheduler = Scheduler(pool, BLOCK, OutputProcessor((), config.max_model_len), 48, watermark_blocks=0)
    engine = DecodeEngine(scheduler, runner, Sampler("cuda"), threading.RLock(), threading.Lock(),
                          async_scheduling=async_scheduling)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(NUM_REQUESTS)}
    done = asyncio.Event()
    finished: set[str] = set()

    def collect(outputs) -> None:
        for output in outputs:
            tokens[output.request_id] += output.delta.token_ids
            if output.delta.finish_reason is not None:
                finished.add(output.request_id)
        if len(finished) == NUM_REQUESTS:
            done.set()

    engine.on_outputs = collect
    try:
        for i in range(NUM_REQUESTS):  # all prefilled before the loop starts: both loops see the same batches
            prompt = [(17 * i + 3 * j) % config.vocab_size for j in range(5 + 3 * i)]
            request = DecodeRequest(f"r{i}", prompt, params(i), IncrementalDetokenizer(NoTextDecoder(), prompt),
                                    StopChecker(()))
            with engine.state_lock:
                assert scheduler.reserve(request) is None
            table = request.block_ids[: blocks_needed(len(prompt), BLOCK)]
            with engine.model_lock:
                out = runner.prefill([PrefillChunk(prompt, 0, table)])
            first = Sampler("cuda")(out.logits, [SamplingRequest(request.sampling, prompt)]).token_ids[0]
            engine.kv_complete(f"r{i}", first, None)
        engine.start(asyncio.get_running_loop())
        await asyncio.wait_for(done.wait(), 120)
    finally:
        engine.stop()
    if stats is not None:
        stats.append(engine.stats)
    assert_no_leak(pool)
    return [tokens[f"r{i}"] for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    config = get_preset("smollm2-135m")
    torch.manual_seed(0)
    weights = dummy_weights(config, torch.bfloat16, "cuda")
    built = ModelRunner(config, CacheConfig(num_blocks=NUM_REQUESTS * 8, block_size=BLOCK), weights, "cuda",
                        torch.bfloat16, max_num_seqs=48)
    assert built.graphs is not None
    return built


async def test_overlapped_loop_on_cuda_gives_the_synchronous_loops_tokens(runner: ModelRunner) -> None:
    stats: list[DecodeStats] = []
    overlapped = await run(runner, async_scheduling=True, stats=stats)
    synchronous = await run(runner, async_scheduling=False)
    assert overlapped == synchronous
    # the device's own time per step (CUDA events) is counted, and the forwards ran whole graph buckets
    [counted] = stats
    assert counted.device_seconds["forward"] > 0 and counted.device_seconds["sample"] > 0
    assert counted.device_seconds["forward"] < counted.step_seconds
    assert counted.num_forward_rows > counted.num_batched_rows  # 37 rows replay the 40 graph
    assert [len(t) for t in overlapped] == [exact(i).max_tokens for i in range(NUM_REQUESTS)]  # P's first too


async def test_stop_tokens_and_penalties_finish_and_free_every_block(runner: ModelRunner) -> None:
    tokens = await run(runner, async_scheduling=True, params=mixed)
    assert all(1 <= len(t) <= mixed(i).max_tokens for i, t in enumerate(tokens))
