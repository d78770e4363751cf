"""A decode worker's first constrained requests while xgrammar loads: the reservation answers without waiting
for the grammar compiler (its first load costs ~1.4 s of CPU, longer on a busy host than the router's
--reserve-timeout-s), P's first token is held until the matcher is attached, and the text is the offline
engine's, constrained. Real model, real xgrammar; the load is held back by an event so the order is certain.
"""

from __future__ import annotations

import asyncio
import threading
import time

from pdserve.decode_node.engine import DecodeEngine
from pdserve.decode_node.node import DecodeNode, DecodeNodeConfig
from pdserve.engine.grammar import GrammarBackend
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured_output import StructuredOutput
from pdserve.kv_transfer.local import LocalKVReceiver
from pdserve.protocol.messages import Refused, Reserve, Reserved
from tests.decode_node.test_decode_engine import BLOCK_SIZE, Deltas, build, play_prefill

PROMPT = "Write a phone number:"
PATTERN = StructuredOutput("regex", "[0-9]{3}-[0-9]{4}")


class HeldLoad(GrammarBackend):
    """The real backend, whose one-time load starts only once the test lets it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()

    def load(self):
        assert self.go.wait(60), "the test never released the grammar load"
        return super().load()


def node_over(loaded_default, engine: DecodeEngine, runner, grammars: GrammarBackend) -> DecodeNode:
    config = loaded_default.config
    receiver = LocalKVReceiver(runner.kv_caches, engine.kv_complete, engine.kv_failed)
    node_config = DecodeNodeConfig(config.max_model_len, config.vocab_size, BLOCK_SIZE, 30.0, "test")
    return DecodeNode(engine, receiver, loaded_default.tokenizer, node_config, grammars)


def reserve(request_id: str, prompt: list[int], params: SamplingParams, max_local_prefill: int = 0) -> Reserve:
    return Reserve(request_id, prompt, params.to_dict(), None, time.time(), max_local_prefill)


async def test_a_reservation_does_not_wait_for_the_first_grammar_load(loaded_default, offline, one_thread) -> None:
    tokenizer = loaded_default.tokenizer
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0.0, structured=PATTERN)
    [expected] = offline.generate([prompt], params)
    assert len(expected.text) == 8 and expected.text[3] == "-", expected.text  # the pattern held offline

    runner, pool, scheduler, engine = build(loaded_default, num_blocks=32, max_num_seqs=4)
    grammars = HeldLoad(tokenizer, loaded_default.config.vocab_size, sorted(loaded_default.config.eos_token_ids))
    node = node_over(loaded_default, engine, runner, grammars)
    deltas = Deltas(engine)
    await node.start()
    try:
        # a short prompt D could prefill itself: not while its matcher is missing (P samples the first token)
        answer = await asyncio.wait_for(node.reserve(reserve("r1", prompt, params, max_local_prefill=512)), 30)
        assert isinstance(answer, Reserved) and not answer.local_prefill, answer
        assert not grammars.ready  # answered before the compiler loaded
        request = scheduler.queues.requests["r1"]
        assert request.grammar is None and request.grammar_loading is not None

        play_prefill(runner, request)  # the prompt's KV into the reserved blocks, as P's transfer would
        first = expected.token_ids[0]
        engine.kv_complete("r1", first, None)  # P's first token arrives before the matcher exists
        await asyncio.sleep(0.3)
        assert deltas.queue("r1").empty()  # held: accepting it needs the matcher
        assert scheduler.queues.requests["r1"].output_token_ids == []

        grammars.go.set()
        text, reason = await asyncio.wait_for(deltas.text("r1"), 120)
        assert text == expected.text and reason == expected.finish_reason
        assert grammars.ready and request.grammar is not None

        # once loaded, a reservation attaches its matcher before answering (a compile is milliseconds)
        answer = await asyncio.wait_for(node.reserve(reserve("r2", prompt, params)), 30)
        assert isinstance(answer, Reserved)
        assert scheduler.queues.requests["r2"].grammar is not None
        assert scheduler.queues.requests["r2"].grammar_loading is None
        engine.abort("r2", "test done")
    finally:
        await node.stop()
    assert pool.num_free == pool.num_total or scheduler.prefix_cache is not None


async def test_an_abort_while_the_grammar_loads_frees_the_blocks_and_a_bad_spec_is_refused(
        loaded_default, one_thread) -> None:
    tokenizer = loaded_default.tokenizer
    prompt = tokenizer.encode(PROMPT)
    runner, pool, scheduler, engine = build(loaded_default, num_blocks=32, max_num_seqs=4)
    grammars = HeldLoad(tokenizer, loaded_default.config.vocab_size, sorted(loaded_default.config.eos_token_ids))
    node = node_over(loaded_default, engine, runner, grammars)
    await node.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, structured=PATTERN)
        assert isinstance(await node.reserve(reserve("gone", prompt, params)), Reserved)
        assert pool.num_free < pool.num_total
        node.abort("gone", "client hung up")
        assert pool.num_free == pool.num_total and "gone" not in scheduler.queues.requests
        engine.kv_complete("gone", 5, None)  # a late first token of the aborted request changes nothing

        # a spec xgrammar cannot compile, while the compiler still loads: the reservation is refused with a 400
        # if it fails before the reservation is made, else the request ends (P refuses it with a 400 as well)
        bad = SamplingParams(max_tokens=4, temperature=0.0, structured=StructuredOutput("regex", "[0-9"))
        answer = await node.reserve(reserve("bad", prompt, bad))
        grammars.go.set()
        if isinstance(answer, Refused):
            assert answer.status == 400
        else:
            for _ in range(600):
                if "bad" not in scheduler.queues.requests:
                    break
                await asyncio.sleep(0.1)
            assert "bad" not in scheduler.queues.requests
        assert pool.num_free == pool.num_total
        # loaded now: the same bad spec is refused at once
        answer = await node.reserve(reserve("bad2", prompt, bad))
        assert isinstance(answer, Refused) and answer.status == 400 and "regex" in answer.message, answer
    finally:
        await node.stop()
