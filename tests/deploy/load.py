"""Continuous client load with the official `openai` client (no retries: every failure is counted).

`ContinuousLoad(url).start()` runs `concurrency` client loops on their own event loop thread until `stop()`;
each loop alternates streamed completions and non-streamed chat completions with short prompts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import openai

MODEL = "smollm2-135m-instruct"


@dataclass
class LoadResult:
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


class ContinuousLoad:
    def __init__(self, base_url: str, concurrency: int = 4, max_tokens: int = 10) -> None:
        self.base_url = base_url
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.result = LoadResult()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    @property
    def completed(self) -> int:
        return self.result.completed

    def start(self) -> ContinuousLoad:
        self._thread.start()
        return self

    def stop(self) -> LoadResult:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the load did not stop within 120 s"
        return self.result

    def wait_for(self, more: int, timeout_s: float = 60.0) -> None:
        """Block until `more` further requests completed."""
        target = self.result.completed + more
        deadline = time.monotonic() + timeout_s
        while self.result.completed < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.result.completed} of {target} requests completed after {timeout_s:g} s; "
                                   f"failures: {self.result.failures[:3]}")
            time.sleep(0.05)

    async def _run(self) -> None:
        async with openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as api:
            await asyncio.gather(*(self._loop(api, i) for i in range(self.concurrency)))

    async def _loop(self, api: openai.AsyncOpenAI, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if n % 2 == 0:
                    await self._stream(api, f"Client {client}, request {n}: list some animals.")
                else:
                    await self._chat(api, f"Client {client}, request {n}: name a colour.")
            except Exception as exc:  # noqa: BLE001 - any failure, of any kind, is a finding: keep its message
                self.result.failures.append(f"client {client} request {n}: {exc!r}")
            else:
                self.result.completed += 1
                self.result.latencies_s.append(time.monotonic() - started)
            n += 1

    async def _stream(self, api: openai.AsyncOpenAI, prompt: str) -> None:
        stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens, temperature=0.0,
                                              stream=True, extra_body={"ignore_eos": True})
        finish, pieces = None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                pieces += 1
        if finish != "length" or pieces == 0:
            raise AssertionError(f"stream ended with finish_reason {finish!r} after {pieces} chunks")

    async def _chat(self, api: openai.AsyncOpenAI, prompt: str) -> None:
        reply = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=self.max_tokens, temperature=0.0,
                                                  extra_body={"ignore_eos": True})
        if reply.usage is None or reply.usage.completion_tokens != self.max_tokens:
            raise AssertionError(f"chat reply with usage {reply.usage}")
