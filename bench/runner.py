"""Drives the load: conversations start on a gamma-process schedule (shape = burstiness; 1 is Poisson) at
`request_rate` per second (inf: all at once), at most `max_concurrency` requests are in flight, and a
conversation's turns go one after another, each carrying the earlier turns and the server's answers."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import ApiTarget, Prompt, RequestOutput, send_request
from pdserve.bench.datasets import Conversation


@dataclass(frozen=True)
class LoadSpec:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate must be positive (inf for all at once), got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be positive, got {self.max_concurrency}")


@dataclass(frozen=True)
class RunResult:
    outputs: list[RequestOutput]  # conversation by conversation, turns in order
    duration: float  # seconds from the first send to the last answer


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Start times (s) of n arrivals: the first at 0, then gamma(shape=burstiness, mean=1/rate) gaps."""
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    starts: np.ndarray = np.concatenate([[0.0], np.cumsum(gaps)])
    return starts


def turn_prompt(conv: Conversation, k: int, answers: list[str], chat: bool) -> Prompt:
    """Turn k's request: chat messages with the history, or the history concatenated as one completion prompt."""
    if k == 0:
        return conv.turns[0].prompt
    turns = conv.turns[: k + 1]
    texts = [t.prompt for t in turns if isinstance(t.prompt, str)]
    if len(texts) != len(turns):
        raise ValueError("multi-turn prompts must be text: give --tokenizer for random multi-turn prompts")
    if chat:
        messages: list[dict[str, str]] = []
        for i in range(k):
            messages += [{"role": "user", "content": texts[i]}, {"role": "assistant", "content": answers[i]}]
        return [*messages, {"role": "user", "content": texts[k]}]
    return "".join(f"{texts[i]}\n\n{answers[i]}\n\n" for i in range(k)) + texts[k]


def _history_len(conv: Conversation, k: int, done: list[RequestOutput]) -> int:
    """Tokens in turn k's prompt when every count is known, else 0 (the server's usage numbers are used)."""
    counts = [t.prompt_len for t in conv.turns[: k + 1]] + [o.output_len for o in done[:k]]
    return sum(counts) if all(counts) else 0


class _Driver:
    def __init__(self, http: httpx.AsyncClient, target: ApiTarget, load: LoadSpec, bar: tqdm, t0: float) -> None:
        self.http, self.target, self.bar, self.t0 = http, target, bar, t0
        self.gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def conversation(self, conv: Conversation, start_at: float) -> list[RequestOutput]:
        await asyncio.sleep(max(0.0, self.t0 + start_at - time.perf_counter()))
        done: list[RequestOutput] = []
        for k, turn in enumerate(conv.turns):
            prompt = turn_prompt(conv, k, [o.generated_text for o in done], self.target.chat)
            out = replace(await self._send(prompt, turn.output_len, _history_len(conv, k, done)), turn=k)
            done.append(out)
            self.bar.update(1)
            if not out.success:
                break  # the history is broken: later turns would not be what the data set says
        return done

    async def _send(self, prompt: Prompt, max_tokens: int, prompt_len: int) -> RequestOutput:
        if self.gate is None:
            return await send_request(self.http, self.target, prompt, max_tokens, prompt_len, self.t0)
        async with self.gate:
            return await send_request(self.http, self.target, prompt, max_tokens, prompt_len, self.t0)


async def run_benchmark(
    conversations: list[Conversation], target: ApiTarget, load: LoadSpec, progress: bool = True
) -> RunResult:
    """Send every conversation on its schedule and wait for all answers."""
    starts = arrival_times(len(conversations), load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    total = sum(len(c.turns) for c in conversations)
    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=load.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(load.request_timeout_s), limits=limits) as http:
        with tqdm(total=total, disable=not progress, desc="requests") as bar:
            t0 = time.perf_counter()
            driver = _Driver(http, target, load, bar, t0)
            per_conv = await asyncio.gather(*(driver.conversation(c, float(s)) for c, s in zip(conversations, starts)))
            duration = time.perf_counter() - t0
    return RunResult([o for outs in per_conv for o in outs], duration)
