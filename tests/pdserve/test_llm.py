"""The offline LLM on the default model (CPU, fp32): a prompt's output does not depend on batching, chunking,
prefix-cache hits or preemption; stop conditions; errors; and no block leaks after any call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.cache_store.block_pool import assert_no_leak
from pdserve.engine.sampling import SamplingParams
from pdserve.llm import LLM

PROMPT = "A short story about a robot who learns to paint. Chapter one: the robot wakes up in an old shed and"
OTHERS = ["Hi", "List three fruits:", "The speed of light is", "def add(a, b):\n    return",
          "In 1969, the first humans landed on", "Paris is the capital of France. Berlin is the capital of",
          "Q: What is the largest ocean on Earth?\nA:"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def make_llm(cache_dir: Path, **kwargs: object) -> LLM:
    options = {"num_blocks": 96, "max_num_seqs": 8, "max_num_batched_tokens": 256} | kwargs
    return LLM(cache_dir=cache_dir, progress=False, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(model_cache_dir: Path) -> Iterator[LLM]:
    llm = make_llm(model_cache_dir)
    yield llm
    assert_no_leak(llm.pool)


@pytest.fixture(autouse=True)
def no_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "llm" in request.fixturenames:
        pool = request.getfixturevalue("llm").pool
        assert_no_leak(pool)
        pool.evict_all_cached()  # each test starts with a cold prefix cache


def test_same_greedy_output_alone_batched_chunked_and_cached(llm: LLM) -> None:
    alone = llm.generate([PROMPT], GREEDY)[0]
    assert alone.num_cached_tokens == 0 and len(alone.token_ids) == 16 and alone.finish_reason == "length"
    llm.pool.evict_all_cached()
    batched = llm.generate(OTHERS[:3] + [PROMPT] + OTHERS[3:], GREEDY)
    assert batched[3].token_ids == alone.token_ids and batched[3].text == alone.text
    llm.pool.evict_all_cached()
    llm.chunk_size = 16
    try:
        chunked = llm.generate([PROMPT] + OTHERS, GREEDY)[0]
    finally:
        llm.chunk_size = llm.max_num_batched_tokens
    assert chunked.token_ids == alone.token_ids and chunked.num_cached_tokens == 0
    cached = llm.generate([PROMPT], GREEDY)[0]  # the prompt's full blocks were committed by the last call
    assert cached.num_cached_tokens == (cached.num_prompt_tokens - 1) // 16 * 16 > 0
    assert cached.token_ids == alone.token_ids


def test_prompts_share_a_cached_prefix(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPT + " " + OTHERS[-1])
    assert len(ids) > 32
    first = llm.generate([ids[:32] + [1000, 1001, 1002]], GREEDY)[0]
    second = llm.generate([ids[:32] + [2000, 2001]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert llm.pool.num_cached >= 2


def test_preemption_does_not_change_outputs(model_cache_dir: Path, llm: LLM) -> None:
    """8 sequences of ~40 tokens need ~24 blocks; 14 force preemption and recompute."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = llm.generate([PROMPT] + OTHERS, params)
    small = make_llm(model_cache_dir, num_blocks=14)
    outs = small.generate([PROMPT] + OTHERS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert small.stats.num_preemptions > 0 and llm.stats.num_preemptions == 0
    assert_no_leak(small.pool)


def test_seeded_sampling_is_reproducible_alone_and_batched(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].token_ids
    mixed = [SamplingParams(max_tokens=5, temperature=1.0)] * 2 + [seeded] + [GREEDY] * 2
    batched = llm.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:4], mixed)[2].token_ids
    assert batched == alone
    reseeded = SamplingParams(max_tokens=12, temperature=0.9, seed=8, ignore_eos=True)
    other_seed = llm.generate([PROMPT], reseeded)
    assert other_seed[0].token_ids != alone


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    base = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert base.text == llm.tokenizer.decode(base.token_ids, skip_special_tokens=True)
    stop = base.text[10:14]
    cut = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[: base.text.index(stop)]
    token = base.token_ids[5]
    until = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[token]))[0]
    assert until.finish_reason == "stop"
    assert until.token_ids == base.token_ids[: base.token_ids.index(token) + 1]


def test_eos_ends_a_chat_answer_unless_ignored(llm: LLM) -> None:
    answer = llm.generate(["What is 2 + 2?"], SamplingParams(max_tokens=40, temperature=0), use_chat=True)[0]
    assert answer.finish_reason == "stop" and answer.token_ids[-1] in llm.eos_token_ids
    assert "4" in answer.text and "<|im_end|>" not in answer.text
    n = len(answer.token_ids)
    params = SamplingParams(max_tokens=n + 3, temperature=0, ignore_eos=True)
    longer = llm.generate(["What is 2 + 2?"], params, use_chat=True)[0]
    assert longer.finish_reason == "length" and longer.token_ids[:n] == answer.token_ids
    assert len(longer.token_ids) == n + 3


def test_logprobs_are_returned_when_asked(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry is not None and entry.token_id == token and entry.top[0][0] == token
    assert llm.generate([PROMPT], GREEDY)[0].logprobs is None


def test_prompt_too_long_names_both_numbers(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1 has 9000 tokens; the model's limit is 8192"):
        llm.generate([[5, 6], [7] * 9000], GREEDY)
    with pytest.raises(ValueError, match=r"need 101 KV blocks; the pool holds 1536 tokens \(96 blocks"):
        llm.generate([[7] * 1600], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY])


def test_stream_yields_the_same_text_and_frees_blocks_when_closed(llm: LLM) -> None:
    full = llm.generate([PROMPT], GREEDY)[0].text
    assert "".join(llm.stream(PROMPT, GREEDY)) == full
    deltas = llm.stream(PROMPT, GREEDY)
    assert next(deltas)
    assert llm.pool.num_used > 0
    deltas.close()
    assert llm.pool.num_used == 0
