"""--kv-load-failure-policy and --max-queued-requests on the decode scheduler: a reservation whose KV never
came is failed or recomputed on D; a full waiting queue refuses new reservations. No block leaks."""

from __future__ import annotations

import pytest
from test_scheduler import BS, EOS_ID, ids, make, run_to_end

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.decode_node.request import RequestState
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.output import OutputProcessor


def scheduler(policy: str, num_blocks: int = 16, max_waiting: int | None = None) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), BS, OutputProcessor((EOS_ID,), 1000), 8, watermark_blocks=0,
                     kv_load_failure_policy=policy, max_waiting=max_waiting)


def test_recompute_prefills_the_prompt_then_samples_the_first_token_on_d(char_tokenizer) -> None:
    sched = scheduler("recompute")
    request = make(char_tokenizer, "r", "abcdef", max_tokens=3)
    assert sched.reserve(request) is None
    assert sched.kv_failed("r", "lease of 2 s expired") == []  # no error frame: it goes on here
    assert request.state == RequestState.PREEMPTED and sched.pool.num_free == 16
    assert sched.reserve(make(char_tokenizer, "late", "ab")) is not None  # recompute first, then new work
    batch = sched.schedule()
    [recompute] = batch.recompute
    assert recompute.token_ids == ids("abcde") and len(recompute.block_ids) == 2
    [item] = batch.decode
    assert (item.token_id, item.position) == (ids("f")[0], 5)  # the prompt's last token samples the first one
    [first] = sched.update(batch, ids("x"))
    assert first.delta.token_ids == ids("x") and first.delta.finish_reason is None and first.delta.error is None
    frames = run_to_end(sched, lambda r: ids("y")[0])
    assert "".join(f.delta.text for f in [first, *frames]) == "xyy" and frames[-1].delta.finish_reason == "length"
    assert (sched.num_kv_load_failures, sched.num_kv_recomputes) == (1, 1)
    assert_no_leak(sched.pool)


def test_recompute_of_a_one_token_prompt_has_nothing_to_prefill(char_tokenizer) -> None:
    sched = scheduler("recompute")
    sched.reserve(make(char_tokenizer, "one", "a", max_tokens=1))
    sched.kv_failed("one", "P gone")
    batch = sched.schedule()
    assert batch.recompute == [] and [(i.token_id, i.position) for i in batch.decode] == [(0, 0)]
    [out] = sched.update(batch, ids("b"))
    assert out.delta.finish_reason == "length" and out.delta.text == "b"
    assert_no_leak(sched.pool)


def test_fail_policy_ends_with_an_error_frame(char_tokenizer) -> None:
    sched = scheduler("fail")
    sched.reserve(make(char_tokenizer, "f", "abc"))
    [out] = sched.kv_failed("f", "connection lost")
    assert out.delta.finish_reason == "error" and out.delta.error == "connection lost"
    assert (sched.num_kv_load_failures, sched.num_kv_recomputes) == (1, 0)
    assert_no_leak(sched.pool)


def test_waiting_limit_refuses_with_503_and_retry_after(char_tokenizer) -> None:
    sched = scheduler("fail", max_waiting=2)
    assert sched.reserve(make(char_tokenizer, "a", "abc")) is None
    assert sched.reserve(make(char_tokenizer, "b", "abc")) is None
    refusal = sched.reserve(make(char_tokenizer, "c", "abc"))
    assert refusal is not None and refusal.status == 503 and refusal.retry_after > 0
    assert "queue full: 2 requests wait" in refusal.message and "--max-queued-requests 2" in refusal.message
    sched.kv_complete("a", ids("x")[0])
    sched.update(sched.schedule(), ids("y"))  # a runs now: one place in the queue again
    assert sched.reserve(make(char_tokenizer, "c", "abc")) is None
    for rid in "abc":
        sched.abort(rid)
    assert_no_leak(sched.pool)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_load_failure_policy must be one of"):
        scheduler("retry")
