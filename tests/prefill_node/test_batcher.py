"""Prefill batcher: token budget, chunking, prefix-cache reuse, FIFO admission by blocks, no leaked block."""

from __future__ import annotations

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.hashing import block_hashes
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.engine.sampling import SamplingParams
from pdserve.kv_transfer.target import TransferTarget
from pdserve.prefill_node.batcher import Batcher
from pdserve.prefill_node.request import PrefillRequest, PrefillState

BS = 4


def make(rid: str, prompt: list[int]) -> PrefillRequest:
    target = TransferTarget("local", rid, (0,), num_layers=1, block_size=BS, dtype="float32")
    return PrefillRequest(rid, prompt, SamplingParams(), target, block_hashes(prompt, BS, "test-model"))


def batcher(num_blocks: int = 64, budget: int = 16) -> Batcher:
    return Batcher(PrefixCache(BlockPool(num_blocks), BS), max_num_batched_tokens=budget)


def drain(b: Batcher) -> list[list[tuple[str, int, int]]]:
    """Run forwards until idle; each plan as (request, start, end) rows. Finished requests are finished."""
    plans = []
    while b.has_work:
        plan = b.schedule()
        assert plan.num_tokens <= b.max_num_batched_tokens
        plans.append([(c.request.request_id, c.start, c.end) for c in plan.chunks])
        for request in b.update(plan):
            b.finish(request)
    return plans


def test_several_prompts_share_one_forward_under_the_token_budget():
    b = batcher(budget=16)
    for rid, n in [("a", 5), ("b", 6), ("c", 9)]:
        b.add(make(rid, list(range(100, 100 + n))))
    plans = drain(b)
    assert plans == [[("a", 0, 5), ("b", 0, 6), ("c", 0, 4)], [("c", 4, 9)]]  # c's first chunk ends on a block edge
    assert_no_leak_but_cached(b)


def test_long_prompt_is_chunked_and_keeps_going_first():
    b = batcher(budget=8)
    b.add(make("long", list(range(20))))
    b.add(make("short", [7, 8, 9]))
    plans = drain(b)
    # the short one queued behind goes in the long one's first forward (within half the budget), and the long
    # one takes the rest, to a block edge; then it keeps going first
    assert plans == [[("short", 0, 3), ("long", 0, 4)], [("long", 4, 12)], [("long", 12, 20)]]
    assert_no_leak_but_cached(b)


def test_short_prompts_do_not_wait_a_forward_behind_a_long_ones_first_chunk():
    """Issue 16's prefill kill: the surviving worker finishes its own long prompt while a retried long prompt
    and new short ones queue; the short ones go in the next forward, the long ones keep at least half of it."""
    b = batcher(budget=16)
    b.add(make("own", list(range(20))))
    first = b.schedule()
    assert [(c.request.request_id, c.start, c.end) for c in first.chunks] == [("own", 0, 16)]
    b.update(first)
    b.add(make("retried", list(range(200, 230))))
    for i in range(3):
        b.add(make(f"new{i}", [300 + i, 301, 302]))
    plans = drain(b)
    assert plans[0] == [("own", 16, 20), ("new0", 0, 3), ("new1", 0, 3), ("retried", 0, 4)]
    # new2 did not fit in half of what was left: once the retried one prefills, it continues first again
    assert plans[1:] == [[("retried", 4, 20)], [("retried", 20, 30), ("new2", 0, 3)]]
    assert_no_leak_but_cached(b)


def test_cached_prefix_is_not_computed_again():
    b = batcher(budget=64)
    shared = list(range(50, 62))  # 3 full blocks
    b.add(make("first", shared + [1, 2]))
    assert drain(b) == [[("first", 0, 14)]]
    b.add(make("second", shared + [3]))
    b.add(make("exact", shared))  # fully cached: the last token is computed again for its logits
    plans = drain(b)
    assert plans == [[("second", 12, 13), ("exact", 8, 12)]]
    assert b.cache.stats.num_hit_blocks == 3 + 2
    assert_no_leak_but_cached(b)


def test_admission_waits_for_blocks_in_order_and_refuses_what_never_fits():
    b = batcher(num_blocks=4, budget=64)
    b.add(make("a", list(range(12))))  # 3 blocks
    b.add(make("b", list(range(100, 108))))  # 2 blocks: must wait for a
    b.add(make("huge", list(range(200, 240))))  # 10 blocks > 4: refused when it reaches the head
    first = b.schedule()
    assert [c.request.request_id for c in first.chunks] == ["a"]
    assert b.queue[0].request_id == "b"
    for request in b.update(first):
        b.finish(request)
    second = b.schedule()
    assert [c.request.request_id for c in second.chunks] == ["b"]
    assert [r.request_id for r in second.failed] == ["huge"] and "needs 10 KV blocks" in second.failed[0].error
    for request in b.update(second):
        b.finish(request)
    assert_no_leak_but_cached(b)


def test_abort_inside_a_forward_and_while_queued():
    b = batcher(budget=4)
    b.add(make("a", list(range(10))))
    b.add(make("q", list(range(10, 14))))
    plan = b.schedule()
    assert b.abort("a") is None  # inside the forward: only marked
    assert b.abort("q").state == PrefillState.ABORTED
    assert b.update(plan) == []
    assert not b.has_work and b.requests == {}
    assert_no_leak(b.pool)


def assert_no_leak_but_cached(b: Batcher) -> None:
    """Committed prompt blocks stay cached (evictable, counted free); nothing else is held."""
    assert b.requests == {} and not b.has_work
    assert b.pool.num_free == b.pool.num_total
    b.pool.evict_all_cached()
    assert_no_leak(b.pool)


def test_tiered_cache_loads_fetched_blocks_at_admission_and_writes_computed_ones_down():
    import torch

    from pdserve.cache_store.policy import CachePolicy, TierConfig
    from pdserve.cache_store.tiered import TieredKVCache

    pool = BlockPool(32)
    cache = PrefixCache(pool, BS)
    kv_caches = [torch.zeros((2, 32, BS, 1, 4))]
    tiered = TieredKVCache(cache, kv_caches, "test-model", TierConfig(host_capacity_gb=16 * 128 / (1 << 30)),
                           CachePolicy())
    b = Batcher(cache, max_num_batched_tokens=64, tiered=tiered)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks, all 3 looked up
    b.add(make("a", prompt))
    assert drain(b) == [[("a", 0, 13)]]
    assert tiered.flush() and tiered.stats.host_written_blocks == 3  # write-through of the computed blocks
    tiered.drop_cached(device=True, host=False)
    again = make("b", prompt)
    again.fetched = tiered.fetch(again.block_hashes[:3], None)
    b.add(again)
    assert drain(b) == [[("b", 12, 13)]], "the 3 blocks came from host RAM: only the last token is computed"
    assert again.num_cached_tokens == 12 and again.fetched is None and tiered.stats.host_reused_tokens == 12
    tiered.close()
    pool.evict_all_cached()
    assert_no_leak(pool)
