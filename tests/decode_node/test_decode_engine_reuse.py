"""The decode engine with the real model and its own prefix cache: a conversation's second turn, on the
history the first turn left in D's pool, gives the offline engine's greedy text both ways D can take it:

    local   RESERVE with max_local_prefill: D prefills the uncached suffix itself (LOCAL_PREFILL), no P
    delta   a plain reservation: D's cached prefix is kept, P (played here by `runner.prefill`) computes and
            writes only the blocks after it, then hands the first token over

and every block is free or evictable afterwards. P's own part is tested in tests/prefill_node.
"""

from __future__ import annotations

import asyncio
import threading

import torch
from test_decode_engine import BLOCK_SIZE, Deltas

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak, blocks_needed
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.decode_node.engine import DecodeEngine
from pdserve.decode_node.request import DecodeRequest, RequestState
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.attention_metadata import PrefillChunk
from pdserve.engine.config import CacheConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.output import OutputProcessor
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import Sampler, SamplingParams, SamplingRequest

FP = "test-fingerprint"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Worker:
    """A decode worker's engine over a pool with its prefix cache and tiered cache (device tier only)."""

    def __init__(self, loaded, num_blocks: int = 64) -> None:
        config = loaded.config
        self.runner = ModelRunner(config, CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE), loaded.weights,
                                  "cpu", torch.float32, max_num_seqs=4)
        self.pool = BlockPool(num_blocks)
        cache = PrefixCache(self.pool, BLOCK_SIZE)
        self.tiered = TieredKVCache(cache, self.runner.kv_caches, FP, TierConfig(), CachePolicy())
        scheduler = Scheduler(self.pool, BLOCK_SIZE, OutputProcessor(config.eos_token_ids, config.max_model_len), 4,
                              watermark_blocks=0, prefix_cache=cache, tiered=self.tiered)
        self.engine = DecodeEngine(scheduler, self.runner, Sampler(), threading.RLock(), threading.Lock())
        self.deltas = Deltas(self.engine)
        self.token_ids: dict[str, list[int]] = {}
        self.engine.on_outputs = self._keep

    def _keep(self, outputs) -> None:
        for output in outputs:
            self.token_ids.setdefault(output.request_id, []).extend(output.delta.token_ids)
        self.deltas.put(outputs)

    def reserve(self, tokenizer, rid: str, prompt: list[int], max_local_prefill: int = 0) -> DecodeRequest:
        request = DecodeRequest(rid, prompt, GREEDY, IncrementalDetokenizer(tokenizer, prompt), StopChecker(()),
                                block_hashes=block_hashes(prompt, BLOCK_SIZE, FP))
        with self.engine.state_lock:
            assert self.engine.scheduler.reserve(request, None, max_local_prefill) is None
        self.engine.wake()
        return request

    def play_p(self, request: DecodeRequest) -> None:
        """What P does with D's target: compute the prompt after D's cached prefix into the blocks after it,
        then hand the first token over."""
        prompt, start = request.prompt_token_ids, request.cached_tokens
        table = request.block_ids[: blocks_needed(len(prompt), BLOCK_SIZE)]
        output = self.runner.prefill([PrefillChunk(prompt[start:], start, table)])
        first = Sampler()(output.logits, [SamplingRequest(GREEDY, prompt)]).token_ids[0]
        self.engine.kv_complete(request.request_id, first, None)


async def test_second_turn_on_d_history_equals_offline_locally_and_by_delta(loaded_default, offline,
                                                                           one_thread) -> None:
    tokenizer = offline.tokenizer
    turn1 = tokenizer.encode("The three largest cities of France are")
    d = Worker(loaded_default)
    d.engine.start(asyncio.get_running_loop())
    try:
        d.play_p(d.reserve(tokenizer, "turn1", turn1))
        await asyncio.wait_for(d.deltas.text("turn1"), 60)
        turn2 = turn1 + d.token_ids["turn1"] + tokenizer.encode(" Which one is the oldest?")
        expected = offline.generate([turn2], GREEDY)[0].text

        local = d.reserve(tokenizer, "local", turn2, max_local_prefill=64)
        assert local.state == RequestState.LOCAL_PREFILL
        assert local.cached_tokens == (len(turn1) + len(d.token_ids["turn1"]) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert (await asyncio.wait_for(d.deltas.text("local"), 60))[0] == expected
        assert d.engine.stats.num_local_prefill_tokens == len(turn2) - 1 - local.cached_tokens

        delta = d.reserve(tokenizer, "delta", turn2)
        assert delta.state == RequestState.WAITING_FOR_KV and delta.cached_tokens > local.cached_tokens
        d.play_p(delta)
        assert (await asyncio.wait_for(d.deltas.text("delta"), 60))[0] == expected
        await asyncio.sleep(0.1)
    finally:
        d.engine.stop()
        d.tiered.close()
    assert d.pool.num_cached > 0
    assert_no_leak(d.pool)
