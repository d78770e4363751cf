"""Greedy outputs through the HTTP deployments equal the offline engine's, raw and chat, disaggregated and
colocated; sampling controls (stop strings, max_tokens, seed), the chat template and usage numbers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai
import pytest
import torch

from pdserve.engine.sampling import SamplingParams
from tests.e2e.deployments import MODEL, Deployment

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
COUNT_PROMPT = "Count from one to ten: one, two, three,"
SEED_PROMPT = "My favourite colour is"
QUESTION = "What is 2 + 2?"


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


@dataclass(frozen=True)
class Case:
    """One reference request: the prompt as the router would tokenize it, and its sampling."""

    name: str
    prompt: str | list[int]
    params: SamplingParams


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)


@pytest.fixture(scope="module")
def offline(offline_llm) -> dict[str, object]:
    """Every reference output of this module from ONE batched offline generate call, run on one CPU thread
    (the deployments' workers are busy on the others; two threads here would only contend with them)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    cases = [Case(f"raw-{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    cases += [Case(f"chat-{i}", chat_ids(offline_llm.tokenizer, p), greedy) for i, p in enumerate(PROMPTS)]
    cases += [Case("count", COUNT_PROMPT, SamplingParams(max_tokens=30, temperature=0.0)),
              Case("seeded", SEED_PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=1234)),
              Case("question", chat_ids(offline_llm.tokenizer, QUESTION), SamplingParams(max_tokens=12, temperature=0.0))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outputs = offline_llm.generate([c.prompt for c in cases], [c.params for c in cases])
    finally:
        torch.set_num_threads(threads)
    return {case.name: out for case, out in zip(cases, outputs, strict=True)} | {"question_ids": cases[-1].prompt}


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_greedy_outputs_equal_the_offline_engine(deployment: Deployment, offline: dict, chat: bool) -> None:
    replies = asyncio.run(complete_all(deployment, chat, max_tokens=MAX_TOKENS, temperature=0.0))
    expected_outputs = [offline[f"{'chat' if chat else 'raw'}-{i}"] for i in range(len(PROMPTS))]
    for prompt, reply, expected in zip(PROMPTS, replies, expected_outputs, strict=True):
        choice = reply.choices[0]
        text = choice.message.content if chat else choice.text
        assert text == expected.text, f"{deployment.name} {prompt!r}"
        assert choice.finish_reason == expected.finish_reason
        assert reply.usage.prompt_tokens == expected.num_prompt_tokens
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_stop_strings_and_max_tokens(deployment: Deployment, offline: dict) -> None:
    prompt = COUNT_PROMPT
    expected = offline["count"].text
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


def test_seeded_sampling_is_reproducible_and_matches_offline(deployment: Deployment, offline: dict) -> None:
    prompt = SEED_PROMPT

    async def run() -> list:
        async with client(deployment) as api:
            calls = [api.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed)
                     for seed in (1234, 1234, 99)]
            return await asyncio.gather(*calls)

    first, again, other = (r.choices[0].text for r in asyncio.run(run()))
    assert first == again == offline["seeded"].text
    assert other != first


def test_chat_template_and_usage(deployment: Deployment, offline: dict) -> None:
    question = QUESTION
    prompt_ids = offline["question_ids"]
    expected = offline["question"]

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
