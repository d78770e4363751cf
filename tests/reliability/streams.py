"""Client helpers for the reliability tests: an SSE completion read event by event, with when it ended."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.cluster import MODEL


@dataclass
class StreamResult:
    status: int
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    completion_tokens: int | None = None
    events: int = 0
    sent_at: float = 0.0  # time.monotonic() when the request was sent
    first_at: float | None = None  # ... when its first text arrived
    last_at: float | None = None  # ... when its last text arrived
    ended_at: float = 0.0  # ... of the last byte
    headers: dict[str, str] = field(default_factory=dict)


async def stream_completion(client: httpx.AsyncClient, prompt: list[int] | str, max_tokens: int,
                            cancel_after: int | None = None, **extra: Any) -> StreamResult:
    """POST /v1/completions with stream=true; `cancel_after` events: hang up then (a client cancel)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    sent_at = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result = StreamResult(response.status_code, headers=dict(response.headers), sent_at=sent_at)
        if response.status_code != 200:
            await response.aread()
            result.error = response.json().get("error")
            result.ended_at = time.monotonic()
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            result.events += 1
            if "error" in event:
                result.error = event["error"]
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    result.last_at = time.monotonic()
                    if result.first_at is None:
                        result.first_at = result.last_at
                result.text += choice.get("text") or ""
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            if cancel_after is not None and result.events >= cancel_after and result.finish_reason is None:
                break  # a cancel mid-way: one whose answer is complete already is read to its end
        result.ended_at = time.monotonic()
        return result
