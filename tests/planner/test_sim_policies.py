"""The simulated workers decide as the real nodes do where they share the policy's code (planner/
sim_workers.py): the same chunks as the prefill batcher, the same reservations as the decode scheduler."""

from __future__ import annotations

from pdserve.cache_store.block_pool import BlockPool, assert_no_leak
from pdserve.cache_store.prefix_cache import PrefixCache
from pdserve.decode_node.request import DecodeRequest
from pdserve.decode_node.scheduler import Scheduler
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.engine.output import NoTextDecoder, OutputProcessor
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.sim_workers import DecodeWorker, PrefillWorker
from pdserve.prefill_node.batcher import Batcher
from pdserve.prefill_node.request import PrefillRequest

BLOCK_SIZE = 16


def test_simulated_prefill_chunks_as_the_batcher_does() -> None:
    """Budget 128: the 37-token prompt after the 100-token one gets 16 tokens (a block edge), not 28."""
    lengths = [100, 37, 600, 16, 250, 5]
    pool = BlockPool(256)
    batcher = Batcher(PrefixCache(pool, BLOCK_SIZE), max_num_batched_tokens=128)
    simulated = PrefillWorker(128, BLOCK_SIZE)
    for rid, n in enumerate(lengths):
        batcher.add(PrefillRequest(str(rid), list(range(n)), SamplingParams(), None, []))
        simulated.queue.append(rid)
    none = [0] * len(lengths)
    forwards = 0
    while batcher.has_work:
        plan = batcher.schedule()
        real = [(int(c.request.request_id), c.start, c.end) for c in plan.chunks]
        assert [(c.rid, c.start, c.end) for c in simulated.schedule(lengths, none, none)] == real
        for request in batcher.update(plan):
            batcher.finish(request)
        simulated.finish_iteration(lengths, none, none)
        forwards += 1
    assert forwards == 9 and not simulated.prefilling and not simulated.queue
    assert_no_leak(pool)


def test_simulated_decode_reserves_as_the_scheduler_does() -> None:
    """40 blocks, watermark 1: prompt + 1 blocks each (3, 7, 1, 19, 5) fit; 13 more for the 200-token one do not."""
    prompts = [40, 100, 15, 300, 64, 200, 1]
    pool = BlockPool(40)
    scheduler = Scheduler(pool, BLOCK_SIZE, OutputProcessor((0,), 4096), max_num_seqs=4)
    simulated = DecodeWorker(40, BLOCK_SIZE, max_num_seqs=4)
    answers = []
    for rid, n in enumerate(prompts):
        prompt = [1] * n
        request = DecodeRequest(str(rid), prompt, SamplingParams(), IncrementalDetokenizer(NoTextDecoder(), prompt),
                                StopChecker([]))
        admitted = scheduler.reserve(request) is None
        assert simulated.reserve(n) == admitted
        assert simulated.free == pool.num_free
        answers.append(admitted)
    assert answers == [True, True, True, True, True, False, True]
    for rid in list(scheduler.queues.requests):
        scheduler.abort(rid)
    assert_no_leak(pool)
