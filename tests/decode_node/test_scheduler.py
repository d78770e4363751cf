"""Decode scheduler: admission by free blocks, continuous batching, preemption by recompute, no leaked block.

The model is replaced by a rule that is the scheduler's only input from it (the sampled token per row), so every
schedule/update sequence here is exactly what the engine thread does.
"""

from __future__ import annotations

import torch

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.decode_node.request import DecodeRequest, RequestState
from pdserve.decode_node.scheduler import Scheduler
from pdserve.decode_node.step import DecodeBatch
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.output import OutputProcessor
from pdserve.engine.sampling import SamplingParams

BS = 4
CHARS = "abcdefghijklmnopqrstuvwxyz .!"  # the char_tokenizer fixture's vocabulary, in id order
EOS_ID = len(CHARS)


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def make(tokenizer, rid: str, prompt: str, **sampling) -> DecodeRequest:
    params = SamplingParams(temperature=0.0, **sampling)
    prompt_ids = ids(prompt)
    return DecodeRequest(rid, prompt_ids, params, IncrementalDetokenizer(tokenizer, prompt_ids),
                         StopChecker(params.stop))


def scheduler(num_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), BS, OutputProcessor((EOS_ID,), 1000), max_num_seqs, watermark_blocks=0)


def run_to_end(sched: Scheduler, next_token, max_steps: int = 200) -> list:
    """Step until idle; next_token(request) plays the model. Returns every frame produced."""
    frames = []
    for _ in range(max_steps):
        if not sched.queues.has_work:
            return frames
        batch: DecodeBatch = sched.schedule()
        frames += batch.outputs
        if batch.empty:
            continue
        frames += sched.update(batch, [next_token(item.request) for item in batch.decode])
    raise AssertionError("scheduler did not finish")


def test_reserve_admits_by_free_blocks_and_answers_503_when_full(char_tokenizer):
    sched = scheduler(num_blocks=6)
    assert sched.reserve(make(char_tokenizer, "a", "abcdefg")) is None  # 7 + 1 tokens -> 2 blocks
    assert sched.reserve(make(char_tokenizer, "b", "abcdefghijk")) is None  # 12 -> 3 blocks
    assert sched.pool.num_free == 1
    refusal = sched.reserve(make(char_tokenizer, "c", "abcde"))  # 6 -> 2 blocks, 1 free
    assert refusal is not None and refusal.status == 503 and refusal.retry_after > 0
    assert "2 KV blocks needed, 1 of 6 free" in refusal.message
    too_long = sched.reserve(make(char_tokenizer, "d", "a" * 40))
    assert too_long is not None and too_long.status == 400
    sched.kv_failed("a", "P went away")
    assert sched.reserve(make(char_tokenizer, "c", "abcde")) is None
    sched.kv_failed("b", "P went away")
    sched.kv_failed("c", "P went away")
    assert_no_leak(sched.pool)


def test_first_token_frame_then_batch_limited_by_max_num_seqs(char_tokenizer):
    sched = scheduler(num_blocks=32, max_num_seqs=2)
    for rid in "abc":
        assert sched.reserve(make(char_tokenizer, rid, "hi", max_tokens=3)) is None
        [out] = sched.kv_complete(rid, ids("x")[0], cached_tokens=0)
        assert out.delta.token_ids == ids("x") and out.delta.text == "x" and out.delta.finish_reason is None
    batch = sched.schedule()
    assert [item.request.request_id for item in batch.decode] == ["a", "b"]
    assert [item.position for item in batch.decode] == [2, 2]  # prompt of 2, first token at position 2
    assert sched.queues.waiting[0].request_id == "c"
    sched.update(batch, ids("yy"))
    frames = run_to_end(sched, lambda r: ids("z")[0])
    finals = {f.request_id: f.delta for f in frames if f.delta.finish_reason}
    assert {rid: f.finish_reason for rid, f in finals.items()} == {"a": "length", "b": "length", "c": "length"}
    assert all(f.completion_tokens == 3 and f.prompt_tokens == 2 for f in finals.values())
    assert_no_leak(sched.pool)


def test_preemption_recomputes_and_nothing_leaks(char_tokenizer):
    # 3 requests of 3 prompt tokens (1 block each at reserve); the last step of each feeds 3 + 13 tokens
    # = 4 blocks; 9 blocks cannot hold all three at full length, so the newest is preempted, resumed later.
    sched = scheduler(num_blocks=9)
    for rid in "abc":
        assert sched.reserve(make(char_tokenizer, rid, "abc", max_tokens=14)) is None
        sched.kv_complete(rid, ids("d")[0])
    recomputed = []
    text = {rid: "d" for rid in "abc"}
    for _ in range(100):
        if not sched.queues.has_work:
            break
        batch = sched.schedule()
        recomputed += [(item.request.request_id, len(item.token_ids)) for item in batch.recompute]
        for item in batch.recompute:
            assert len(item.block_ids) * BS >= len(item.token_ids) + 1
        tokens = [ids("e")[0] for _ in batch.decode]
        for out in sched.update(batch, tokens):
            text[out.request_id] += out.delta.text
    assert sched.num_preemptions >= 1 and recomputed
    assert text == {rid: "d" + "e" * 13 for rid in "abc"}  # preemption changes no output
    assert_no_leak(sched.pool)


def test_abort_inside_a_step_is_finished_by_update(char_tokenizer):
    sched = scheduler(num_blocks=8)
    sched.reserve(make(char_tokenizer, "a", "abc", max_tokens=50))
    sched.kv_complete("a", ids("d")[0])
    batch = sched.schedule()
    assert sched.abort("a") == []  # the forward is running: only marked
    assert sched.pool.num_free < 8
    [out] = sched.update(batch, ids("e"))
    assert out.delta.finish_reason == "abort" and out.delta.token_ids == []
    assert_no_leak(sched.pool)


def test_abort_or_failed_transfer_while_waiting_for_kv(char_tokenizer):
    sched = scheduler(num_blocks=8)
    for rid in "abc":
        sched.reserve(make(char_tokenizer, rid, "abc"))
    [aborted] = sched.abort("a")  # the engine cancelled the expected transfer first
    assert aborted.delta.finish_reason == "abort" and sched.pool.num_free == 8 - 2
    assert sched.kv_complete("a", 1) == []  # a done frame arriving late is ignored
    [failed] = sched.kv_failed("b", "sender gave up: aborted")
    assert failed.delta.finish_reason == "error" and failed.delta.error == "sender gave up: aborted"
    [lease] = sched.kv_failed("c", "lease of 30 s expired")
    assert lease.delta.finish_reason == "error" and "lease" in lease.delta.error
    assert_no_leak(sched.pool)


def test_colocated_reserve_takes_cached_prefix_blocks(char_tokenizer):
    pool = BlockPool(16)
    cache = PrefixCache(pool, BS)
    sched = Scheduler(pool, BS, OutputProcessor((EOS_ID,), 1000), 8, watermark_blocks=0, prefix_cache=cache)
    prompt = "abcdefghij"  # 10 tokens: 2 full blocks
    hashes = block_hashes(ids(prompt), BS, "m")
    first = make(char_tokenizer, "first", prompt)
    first.block_hashes = hashes
    sched.reserve(first)
    assert first.cached_tokens == 0 and len(sched.expected_block_ids(first)) == 3
    cache.commit(hashes, first.block_ids)  # what P does after computing them
    second = make(char_tokenizer, "second", prompt)
    second.block_hashes = hashes
    sched.reserve(second)
    assert second.cached_tokens == 8 and second.block_ids[:2] == first.block_ids[:2]
    assert sched.expected_block_ids(second) == second.block_ids[2:3]  # only the last, partial prompt block
    for rid in ("first", "second"):
        sched.kv_complete(rid, ids("x")[0])
        sched.abort(rid)
    pool.evict_all_cached()
    assert_no_leak(pool)


def test_stop_string_across_tokens_eos_and_stop_token_ids(char_tokenizer):
    sched = scheduler(num_blocks=16)
    sched.reserve(make(char_tokenizer, "s", "ab", stop=["lo w"], max_tokens=20))
    sched.reserve(make(char_tokenizer, "e", "ab", max_tokens=20))
    sched.reserve(make(char_tokenizer, "t", "ab", stop_token_ids=[ids("!")[0]], max_tokens=20))
    script = {"s": iter(ids("ello world")), "e": iter(ids("ok") + [EOS_ID]), "t": iter(ids("yes!no"))}
    frames = [o for rid in "set" for o in sched.kv_complete(rid, next(script[rid]))]
    frames += run_to_end(sched, lambda r: next(script[r.request_id]))
    text = {rid: "".join(o.delta.text for o in frames if o.request_id == rid) for rid in "set"}
    assert text == {"s": "el", "e": "ok", "t": "yes"}
    finals = {o.request_id: o.delta for o in frames if o.delta.finish_reason}
    assert {rid: f.finish_reason for rid, f in finals.items()} == {"s": "stop", "e": "stop", "t": "stop"}
    assert finals["s"].completion_tokens == 6  # e l l o, space, w: stopped when "lo w" completed
    assert finals["e"].completion_tokens == 3  # the EOS token counts
    assert_no_leak(sched.pool)


def test_max_tokens_one_finishes_at_kv_complete(char_tokenizer):
    sched = scheduler(num_blocks=4)
    sched.reserve(make(char_tokenizer, "a", "abc", max_tokens=1))
    [out] = sched.kv_complete("a", ids("z")[0])
    assert out.delta.finish_reason == "length" and out.delta.text == "z"
    assert not sched.queues.has_work and sched.queues.requests == {}
    assert sched.queues.requests == {} and RequestState.FINISHED_LENGTH.finished
    assert_no_leak(sched.pool)


def _tiered(pool: BlockPool, cache: PrefixCache, host_blocks: int) -> tuple[TieredKVCache, list[torch.Tensor]]:
    """A tiered cache over a small pool (2 layers, 2 KV heads of 8) with a host tier of `host_blocks`."""
    kv_caches = [torch.zeros((2, pool.num_total, BS, 2, 8)) for _ in range(2)]
    block_bytes = 2 * 2 * BS * 2 * 8 * 4
    config = TierConfig(host_capacity_gb=host_blocks * block_bytes / (1 << 30))
    return TieredKVCache(cache, kv_caches, "m", config, CachePolicy()), kv_caches


def test_finished_sequence_is_committed_and_a_colocated_reserve_loads_it_from_host_ram(char_tokenizer):
    pool = BlockPool(16)
    cache = PrefixCache(pool, BS)
    tiered, kv_caches = _tiered(pool, cache, host_blocks=8)
    sched = Scheduler(pool, BS, OutputProcessor((EOS_ID,), 1000), 8, watermark_blocks=0, prefix_cache=cache,
                      tiered=tiered)
    prompt = "abcdefghij"  # 10 tokens; + 3 generated = 13, 12 with KV: 3 full blocks committed
    first = make(char_tokenizer, "first", prompt, max_tokens=3)
    first.block_hashes = block_hashes(ids(prompt), BS, "m")
    assert sched.reserve(first) is None
    for i, layer in enumerate(kv_caches):  # what P and the decode steps wrote
        layer[:, list(first.block_ids)] = torch.rand(layer[:, list(first.block_ids)].shape, generator=torch.manual_seed(i))
    written = [layer[:, list(first.block_ids[:2])].clone() for layer in kv_caches]
    sched.kv_complete("first", ids("x")[0])
    run_to_end(sched, lambda request: ids("y")[0])
    assert tiered.flush() and tiered.stats.host_written_blocks == 3 and pool.num_cached == 3
    assert tiered.drop_cached(device=True, host=False)["device_blocks"] == 3

    follow_up = make(char_tokenizer, "next", prompt + "xyyq")  # the history and a new turn: 14 tokens
    follow_up.block_hashes = block_hashes(ids(prompt + "xyyq"), BS, "m")
    fetched = tiered.fetch(sched.prefix_lookup_hashes(follow_up), None)
    assert sched.reserve(follow_up, fetched) is None
    assert follow_up.cached_tokens == 12 and tiered.stats.host_reused_tokens == 12
    assert all(torch.equal(layer[:, list(follow_up.block_ids[:2])], old) for layer, old in zip(kv_caches, written))
    assert sched.expected_block_ids(follow_up) == follow_up.block_ids[3:4]
    sched.abort("next")
    tiered.close()
    pool.evict_all_cached()
    assert_no_leak(pool)



def test_an_abort_held_for_its_sender_frees_the_blocks_only_when_released(char_tokenizer):
    """cuda_ipc's deferred release: the request ends at once (its abort delta goes out), its blocks stay taken
    until the receiver says the sender can write them no more; no new request gets them meanwhile."""
    sched = scheduler(num_blocks=3)
    assert sched.reserve(make(char_tokenizer, "a", "abcdefg")) is None  # 2 blocks
    [out] = sched.abort("a", "client gone", hold_blocks=True)
    assert out.delta.finish_reason == "abort" and "a" not in sched.queues.requests
    assert sched.pool.num_free == 1 and set(sched.queues.held) == {"a"}
    assert sched.reserve(make(char_tokenizer, "b", "abcdefg")) is not None  # the held blocks are not free
    sched.queues.release_held("a")
    assert sched.pool.num_free == 3 and not sched.queues.held
    assert sched.reserve(make(char_tokenizer, "b", "abcdefg")) is None
    sched.abort("b")
    assert_no_leak(sched.pool)
