"""A decode worker's own prefix cache (decode_node/prefix.py) and conditional disaggregation (LOCAL_PREFILL) in
the scheduler: the next turn's reservation takes the history the last turn left, P is told to send only the new
blocks, a short uncached suffix is prefilled on D; every block is free or evictable once the sequences end."""

from __future__ import annotations

import torch
from test_scheduler import BS, EOS_ID, ids, make, run_to_end

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.policy import CachePolicy, TierConfig
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.cache_store.tiered import TieredKVCache
from pdserve.decode_node.request import RequestState
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.output import OutputProcessor

FP = "m"
HISTORY = "abcdefghij"  # 10 prompt tokens; + "xyy" generated = 13 tokens, 12 with KV: 3 full blocks committed


def build(num_blocks: int = 16, reuse: bool = True, max_num_seqs: int = 8,
          max_local_prefill_tokens: int | None = None) -> Scheduler:
    """A disaggregated decode worker's scheduler: the pool's prefix cache (or none) and its tiered cache (device
    tier only: no host RAM, no Redis)."""
    pool = BlockPool(num_blocks)
    cache = PrefixCache(pool, BS)
    kv_caches = [torch.zeros((2, num_blocks, BS, 2, 8)) for _ in range(2)]
    tiered = TieredKVCache(cache, kv_caches, FP, TierConfig(), CachePolicy())
    return Scheduler(pool, BS, OutputProcessor((EOS_ID,), 1000), max_num_seqs, watermark_blocks=0,
                     prefix_cache=cache if reuse else None, tiered=tiered,
                     max_local_prefill_tokens=max_local_prefill_tokens)


def request(tokenizer, rid: str, prompt: str, **sampling):
    req = make(tokenizer, rid, prompt, **sampling)
    req.block_hashes = block_hashes(ids(prompt), BS, FP)
    return req


def first_turn(sched: Scheduler, tokenizer) -> None:
    """HISTORY through the usual path: reserved, P's KV and first token, decoded to its end, committed."""
    assert sched.reserve(request(tokenizer, "turn1", HISTORY, max_tokens=3)) is None
    sched.kv_complete("turn1", ids("x")[0])
    run_to_end(sched, lambda r: ids("y")[0])
    assert sched.pool.num_cached == 3 and sched.pool.num_used == 0


def test_the_next_turn_takes_the_history_and_p_sends_only_the_new_blocks(char_tokenizer) -> None:
    sched = build()
    first_turn(sched, char_tokenizer)
    turn2 = request(char_tokenizer, "turn2", HISTORY + "xyyqrs", max_tokens=2)  # 16 tokens: 4 blocks of 4
    assert sched.reserve(turn2) is None and turn2.state == RequestState.WAITING_FOR_KV
    assert turn2.cached_tokens == 12 and sched.num_reused_tokens == 12  # the history's 3 full blocks
    assert [sched.pool.ref_count(b) for b in turn2.block_ids[:3]] == [1, 1, 1]  # taken from the cache
    assert sched.expected_block_ids(turn2) == turn2.block_ids[3:4]  # P writes only the block of "yqrs"
    [out] = sched.kv_complete("turn2", ids("z")[0])
    assert out.delta.cached_tokens == 12
    run_to_end(sched, lambda r: ids("z")[0])
    assert sched.pool.num_cached == 4  # tokens 0..16 of 17 have KV: 4 full blocks named
    assert_no_leak(sched.pool)  # every block free or evictable


def test_without_the_decode_prefix_cache_the_whole_prompt_is_expected(char_tokenizer) -> None:
    sched = build(reuse=False)
    first_turn(sched, char_tokenizer)  # still committed: P's next turn may read it from host RAM / Redis
    turn2 = request(char_tokenizer, "turn2", HISTORY + "xyyqrs")
    assert sched.reserve(turn2, max_local_prefill=1000) is None
    assert turn2.cached_tokens == 0 and turn2.state == RequestState.LOCAL_PREFILL  # the limit alone decides
    sched.abort("turn2")
    turn2 = request(char_tokenizer, "again", HISTORY + "xyyqrs")
    assert sched.reserve(turn2) is None and sched.expected_block_ids(turn2) == turn2.block_ids[:4]
    sched.abort("again")
    assert_no_leak(sched.pool)


def test_a_short_uncached_suffix_is_prefilled_on_d_and_its_decode_row_samples_the_first_token(char_tokenizer):
    sched = build()
    first_turn(sched, char_tokenizer)
    turn2 = request(char_tokenizer, "turn2", HISTORY + "xyyqrs", max_tokens=3)
    assert sched.reserve(turn2, max_local_prefill=5) is None  # 16 - 12 = 4 tokens to compute, < 5
    assert turn2.state == RequestState.LOCAL_PREFILL and sched.num_local_prefills == 1
    assert sched.queues.num_waiting == 1 and sched.queues.has_work
    batch = sched.schedule()
    [local] = batch.recompute
    assert local.local and local.start == 12 and local.token_ids == ids("yqr")  # the last one is the decode row's
    assert local.block_ids == turn2.block_ids
    [row] = batch.decode
    assert (row.request, row.token_id, row.position) == (turn2, ids("s")[0], 15)
    [first] = sched.update(batch, ids("t"))
    assert first.delta.token_ids == ids("t") and first.delta.cached_tokens == 12
    frames = run_to_end(sched, lambda r: ids("u")[0])
    assert "".join(f.delta.text for f in [first, *frames]) == "tuu" and frames[-1].delta.finish_reason == "length"
    assert sched.pool.num_cached == 4
    assert_no_leak(sched.pool)


def test_a_suffix_at_the_limit_or_prompt_logprobs_go_through_p(char_tokenizer) -> None:
    sched = build()
    first_turn(sched, char_tokenizer)
    at_limit = request(char_tokenizer, "limit", HISTORY + "xyyqrs")
    assert sched.reserve(at_limit, max_local_prefill=4) is None  # 4 uncached tokens: not fewer than 4
    assert at_limit.state == RequestState.WAITING_FOR_KV and at_limit.cached_tokens == 12
    logprobs = request(char_tokenizer, "logprobs", HISTORY + "xyyqrs", prompt_logprobs=1)
    assert sched.reserve(logprobs, max_local_prefill=1000) is None  # P computes (and returns) every logprob
    assert logprobs.state == RequestState.WAITING_FOR_KV and logprobs.cached_tokens == 0
    assert sched.num_local_prefills == 0
    sched.abort("limit")
    sched.abort("logprobs")
    assert_no_leak(sched.pool)


def test_local_prefills_wait_for_a_slot_and_an_abort_frees_their_blocks(char_tokenizer) -> None:
    sched = build(max_num_seqs=1)
    first_turn(sched, char_tokenizer)
    assert sched.reserve(request(char_tokenizer, "busy", "qqqq", max_tokens=50)) is None
    sched.kv_complete("busy", ids("q")[0])
    sched.update(batch := sched.schedule(), ids("q") * len(batch.decode))
    queued = request(char_tokenizer, "queued", HISTORY + "xyyqrs")
    assert sched.reserve(queued, max_local_prefill=100) is None
    batch = sched.schedule()  # the one slot is taken: no prefill yet
    assert batch.recompute == [] and queued.state == RequestState.LOCAL_PREFILL
    sched.update(batch, ids("q") * len(batch.decode))
    held = list(queued.block_ids)
    [out] = sched.abort("queued", "client gone")
    assert out.delta.finish_reason == "abort" and not sched.queues.local_prefills
    assert [sched.pool.ref_count(b) for b in held] == [0] * len(held)  # the history evictable, the rest free
    sched.abort("busy")
    run_to_end(sched, lambda r: ids("q")[0])
    assert_no_leak(sched.pool)


def test_an_abort_while_the_local_prefill_runs_ends_at_that_steps_update(char_tokenizer) -> None:
    sched = build()
    first_turn(sched, char_tokenizer)
    turn2 = request(char_tokenizer, "turn2", HISTORY + "xyyqrs")
    sched.reserve(turn2, max_local_prefill=100)
    batch = sched.schedule()  # launched: its forward writes turn2's blocks
    assert sched.abort("turn2") == [] and turn2.abort_requested
    [out] = sched.update(batch, ids("t"))
    assert out.delta.finish_reason == "abort" and out.delta.token_ids == []
    assert sched.pool.num_cached == 3  # an aborted sequence is not committed
    assert_no_leak(sched.pool)


def test_one_step_prefills_at_most_the_token_budget_of_local_prefills_but_always_the_oldest(char_tokenizer):
    """A burst of turns prefilled on D is spread over steps of at most max_local_prefill_tokens prompt tokens
    (the shapes the worker warmed up for), oldest first; one over the budget alone still runs."""
    sched = build(num_blocks=32, max_local_prefill_tokens=6)
    first_turn(sched, char_tokenizer)
    turns = [request(char_tokenizer, f"turn{i}", HISTORY + "xyy" + "pqrs"[i] * 4, max_tokens=1) for i in range(3)]
    for turn in turns:  # 17 tokens each, 12 cached: 4 to prefill, the last one is the decode row
        assert sched.reserve(turn, max_local_prefill=100) is None and turn.state == RequestState.LOCAL_PREFILL
    steps = []
    while sched.queues.local_prefills:
        batch = sched.schedule()
        steps.append([item.request.request_id for item in batch.recompute])
        sched.update(batch, ids("t") * len(batch.decode))
    assert steps == [["turn0"], ["turn1"], ["turn2"]]  # 4 + 4 > 6
    big = build(num_blocks=32, max_local_prefill_tokens=2)
    first_turn(big, char_tokenizer)
    alone = request(char_tokenizer, "alone", HISTORY + "xyyqrs", max_tokens=1)
    assert big.reserve(alone, max_local_prefill=100) is None
    batch = big.schedule()
    [item] = batch.recompute  # 3 tokens > 2: the oldest runs anyway
    assert item.request is alone
    big.update(batch, ids("t") * len(batch.decode))
    for s in (sched, big):
        run_to_end(s, lambda r: ids("t")[0])
        assert_no_leak(s.pool)
