"""The prefill engine with the real model: chunked prefill and prefix reuse on P, KV pushed layer by layer over
a real loopback `tcp` transfer; what arrives in D's blocks equals a one-shot prefill of the whole prompt."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from pdserve.cache_store.block_pool import BlockPool, blocks_needed
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.kv_cache import allocate_kv_caches
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams
from pdserve.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from pdserve.prefill_node.batcher import Batcher
from pdserve.prefill_node.engine import PrefillEngine
from pdserve.prefill_node.request import PrefillRequest

BS = 16
NUM_BLOCKS = 48


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/decode_node/test_decode_engine.py
    yield
    torch.set_num_threads(threads)


async def test_chunked_prefix_reusing_prefill_lands_in_d_blocks(loaded_default, one_thread) -> None:
    config = loaded_default.config
    cache_config = CacheConfig(NUM_BLOCKS, BS)
    runner = ModelRunner(config, cache_config, loaded_default.weights, "cpu", torch.float32, max_num_seqs=4)
    d_pools = allocate_kv_caches(config, cache_config, "cpu", torch.float32)
    completed: dict[str, int] = {}
    receiver = TcpKVReceiver("127.0.0.1", 0, d_pools, lambda rid, tok, lp, top: completed.__setitem__(rid, tok),
                             lambda rid, reason: pytest.fail(f"{rid}: {reason}"))
    await receiver.start()
    pool = BlockPool(NUM_BLOCKS)
    batcher = Batcher(PrefixCache(pool, BS), max_num_batched_tokens=24)  # 50-token prompts take 3 forwards
    engine = PrefillEngine(batcher, runner, Sampler(), TcpKVSender(), threading.RLock(), threading.Lock())
    engine.start(asyncio.get_running_loop())
    shared = list(range(1000, 1040))  # 40 tokens: 2 full blocks + 8
    prompts = [shared + list(range(2000, 2010)), shared + list(range(3000, 3010))]
    d_blocks = [list(range(4)), list(range(10, 14))]  # ceil(50 / 16) = 4 blocks each
    try:
        results = []
        for i, (prompt, dst) in enumerate(zip(prompts, d_blocks, strict=True)):  # one after the other: reuse
            target = receiver.expect(f"r{i}", dst, deadline=None, num_tokens=len(prompt))
            request = PrefillRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), target,
                                     block_hashes(prompt, BS, loaded_default.fingerprint))
            results.append(await asyncio.wait_for(engine.submit(request), 60))
            await asyncio.sleep(0.05)  # the receiver's callback runs on this loop
    finally:
        engine.stop()
        await engine.sender.close()
        await receiver.close()
    assert [r.num_cached_tokens for r in results] == [0, 32]  # 2 full blocks of the shared 40 tokens
    assert [r.num_computed_tokens for r in results] == [50, 18]
    assert completed == {"r0": results[0].first_token_id, "r1": results[1].first_token_id}
    assert pool.num_free == NUM_BLOCKS  # P released its blocks (the committed ones stay cached)
    # r0: a budget of 24 gives chunks 0-16, 16-32, 32-50 (a chunk that stops early ends on a block edge, so no
    # block is sent twice): blocks [0], [1], [2, 3]; r1: one chunk 32-50, sending its cached prefix blocks too
    # (D has none of them): [0, 1, 2, 3]
    block_bytes = 2 * BS * config.num_kv_heads * config.head_dim * 4
    assert engine.stats.transfer_bytes == (4 + 4) * config.num_layers * block_bytes
    for prompt, dst, result in zip(prompts, d_blocks, results, strict=True):
        reference, first = one_shot(runner, prompt)
        assert result.first_token_id == first
        for layer in range(config.num_layers):
            got = d_pools[layer][:, dst][:, :, :].reshape(2, -1, config.num_kv_heads, config.head_dim)[:, :len(prompt)]
            torch.testing.assert_close(got, reference[layer], atol=2e-4, rtol=1e-4)


def one_shot(runner: ModelRunner, prompt: list[int]) -> tuple[list[torch.Tensor], int]:
    """The prompt prefilled in one chunk into the last free blocks of P's runner: per layer K/V and the greedy
    first token."""
    table = list(range(NUM_BLOCKS - blocks_needed(len(prompt), BS), NUM_BLOCKS))
    output = runner.prefill([PrefillChunk(prompt, 0, table)])
    kv = [cache[:, table].reshape(2, -1, *cache.shape[3:])[:, :len(prompt)].clone() for cache in runner.kv_caches]
    return kv, int(output.logits[0].argmax())


async def test_a_target_that_leaves_out_d_cached_blocks_gets_only_the_rest(loaded_default, one_thread) -> None:
    """D holds the prompt's first 2 blocks (its own prefix cache): its target lists only blocks 2-3, and P, which
    computes the whole prompt (its cache is empty), sends nothing before them, in any chunk."""
    config = loaded_default.config
    cache_config = CacheConfig(NUM_BLOCKS, BS)
    runner = ModelRunner(config, cache_config, loaded_default.weights, "cpu", torch.float32, max_num_seqs=4)
    d_pools = allocate_kv_caches(config, cache_config, "cpu", torch.float32)
    completed: dict[str, int] = {}
    receiver = TcpKVReceiver("127.0.0.1", 0, d_pools, lambda rid, tok, lp, top: completed.__setitem__(rid, tok),
                             lambda rid, reason: pytest.fail(f"{rid}: {reason}"))
    await receiver.start()
    batcher = Batcher(PrefixCache(BlockPool(NUM_BLOCKS), BS), max_num_batched_tokens=24)  # chunks 0-16-32-50
    engine = PrefillEngine(batcher, runner, Sampler(), TcpKVSender(), threading.RLock(), threading.Lock())
    engine.start(asyncio.get_running_loop())
    prompt = list(range(1000, 1050))
    try:
        target = receiver.expect("r", [20, 21], deadline=None, num_tokens=len(prompt) - 2 * BS)
        request = PrefillRequest("r", prompt, SamplingParams(temperature=0.0), target,
                                 block_hashes(prompt, BS, loaded_default.fingerprint))
        result = await asyncio.wait_for(engine.submit(request), 60)
        await asyncio.sleep(0.05)
    finally:
        engine.stop()
        await engine.sender.close()
        await receiver.close()
    assert (result.num_cached_tokens, result.num_computed_tokens) == (0, 50) and completed == {"r": result.first_token_id}
    # chunks 0-16 and 16-32 send nothing (blocks 0-1 are D's), 32-50 blocks 2 and 3
    block_bytes = 2 * BS * config.num_kv_heads * config.head_dim * 4
    assert engine.stats.transfer_bytes == 2 * config.num_layers * block_bytes
    reference, _ = one_shot(runner, prompt)
    others = [b for b in range(NUM_BLOCKS) if b not in (20, 21)]
    for layer in range(config.num_layers):
        got = d_pools[layer][:, [20, 21]].reshape(2, -1, config.num_kv_heads, config.head_dim)[:, :len(prompt) - 2 * BS]
        torch.testing.assert_close(got, reference[layer][:, 2 * BS:], atol=2e-4, rtol=1e-4)
        assert not d_pools[layer][:, others].any()
