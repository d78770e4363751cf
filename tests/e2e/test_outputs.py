"""Greedy outputs through the HTTP deployments equal the offline engine's, raw and chat, disaggregated and
colocated; sampling controls (stop strings, max_tokens, seed), the chat template and usage numbers."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pdserve.engine.sampling import SamplingParams
from tests.e2e.conftest import MODEL, Deployment

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Explain photosynthesis in one sentence.",
]
MAX_TOKENS = 20


def client(deployment: Deployment) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=120)


async def complete_all(deployment: Deployment, chat: bool, **kwargs: object) -> list:
    async with client(deployment) as api:
        if chat:
            calls = [api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], **kwargs)
                     for p in PROMPTS]
        else:
            calls = [api.completions.create(model=MODEL, prompt=p, **kwargs) for p in PROMPTS]
        return await asyncio.gather(*calls)


@pytest.fixture(scope="session")
def offline_greedy(offline_llm) -> dict[bool, list]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return {chat: offline_llm.generate(PROMPTS, params, use_chat=chat) for chat in (False, True)}


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_greedy_outputs_equal_the_offline_engine(deployment: Deployment, offline_greedy, chat: bool) -> None:
    replies = asyncio.run(complete_all(deployment, chat, max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, reply, expected in zip(PROMPTS, replies, offline_greedy[chat], strict=True):
        choice = reply.choices[0]
        text = choice.message.content if chat else choice.text
        assert text == expected.text, f"{deployment.name} {prompt!r}"
        assert choice.finish_reason == expected.finish_reason
        assert reply.usage.prompt_tokens == expected.num_prompt_tokens
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stop_strings_and_max_tokens(deployment: Deployment, offline_llm) -> None:
    prompt = "Count from one to ten: one, two, three,"
    expected = offline_llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0].text
    stop = expected[6:9]  # three characters from the middle: the stop string may span tokens
    assert len(expected) > 12 and stop

    async def run() -> tuple:
        async with client(deployment) as api:
            stopped = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.0,
                                                   stop=[stop])
            short = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0)
            return stopped, short

    stopped, short = asyncio.run(run())
    assert stopped.choices[0].text == expected[: expected.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible_and_matches_offline(deployment: Deployment, offline_llm) -> None:
    prompt = "My favourite colour is"
    offline = offline_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=1234))[0]

    async def run() -> list:
        async with client(deployment) as api:
            calls = [api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed)
                     for seed in (1234, 1234, 99)]
            return await asyncio.gather(*calls)

    first, again, other = (r.choices[0].text for r in asyncio.run(run()))
    assert first == again == offline.text
    assert other != first


def test_chat_template_and_usage(deployment: Deployment, offline_llm) -> None:
    question = "What is 2 + 2?"
    rendered = offline_llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    prompt_ids = offline_llm.tokenizer.encode(rendered, add_special_tokens=False)
    expected = offline_llm.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0.0))[0]

    async def run() -> object:
        async with client(deployment) as api:
            return await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                     max_tokens=12, temperature=0.0)

    reply = asyncio.run(run())
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(prompt_ids) + len(expected.token_ids)
