"""A streaming OpenAI client over httpx that timestamps every chunk of the answer.

TTFT is the time from sending the request to the first chunk carrying text; every later chunk carrying text
adds one inter-token latency (a server that packs several tokens into a chunk gives one ITL for them, as in
`vllm bench serve`); the end-to-end latency ends when the stream closes. The token counts come from the
server's `usage` (asked for with stream_options.include_usage) when it sends them.

An answer whose first token is EOS streams no text, only a choice with a finish_reason: it completed (as
`vllm bench serve` counts it: a successful, empty answer of 0 or 1 output tokens), its TTFT is that chunk's
time. Only a stream with neither text nor a finish_reason failed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

Prompt = str | list[int] | list[dict[str, str]]  # text or token ids (completions), or chat messages


@dataclass(frozen=True)
class ApiTarget:
    """Where requests go and the sampling every request shares."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str = "default"
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {self.endpoint!r}")

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


@dataclass(frozen=True)
class RequestOutput:
    """What one request did, in seconds; `start_time` is measured from the start of the benchmark."""

    success: bool
    prompt_len: int  # tokens the benchmark counted in the prompt (0: unknown)
    output_len: int  # tokens generated: the server's usage, else 0 (metrics then count the text)
    ttft: float
    itl: tuple[float, ...]
    latency: float
    start_time: float
    generated_text: str = ""
    error: str = ""
    server_prompt_tokens: int = 0  # usage.prompt_tokens (chat templates included)
    turn: int = 0  # the request's turn in its conversation (0: the first)


@dataclass
class _Recorder:
    """Collects chunk timestamps while a stream is read."""

    sent_at: float
    first_at: float = 0.0
    last_at: float = 0.0
    itl: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    error: str = ""
    finish_reason: str | None = None

    def on_text(self, text: str, now: float) -> None:
        if not self.pieces:
            self.first_at = now
        else:
            self.itl.append(now - self.last_at)
        self.last_at = now
        self.pieces.append(text)

    def on_chunk(self, chunk: dict[str, Any], chat: bool, now: float) -> None:
        if "error" in chunk:
            error = chunk["error"]
            self.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if text:
                self.on_text(text, now)
            if choice.get("finish_reason") and self.finish_reason is None:
                self.finish_reason = choice["finish_reason"]
                if not self.pieces:  # an empty answer (EOS first): its end is its first token
                    self.first_at = now


async def send_request(
    http: httpx.AsyncClient, target: ApiTarget, prompt: Prompt, max_tokens: int, prompt_len: int, t0: float
) -> RequestOutput:
    """Send one streaming request and time it; errors (HTTP or in the stream) come back as success=False."""
    rec = _Recorder(sent_at=time.perf_counter())
    try:
        async with http.stream("POST", target.url, json=target.payload(prompt, max_tokens),
                               headers=target.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                rec.error = f"HTTP {response.status_code}: {body[:500]}"
            else:
                await _read_events(response, rec, target.chat)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return _result(rec, time.perf_counter(), prompt_len, t0)


async def _read_events(response: httpx.Response, rec: _Recorder, chat: bool) -> None:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        rec.on_chunk(json.loads(data), chat, time.perf_counter())
        if rec.error:
            break


def _result(rec: _Recorder, end: float, prompt_len: int, t0: float) -> RequestOutput:
    ok = not rec.error and (bool(rec.pieces) or rec.finish_reason is not None)
    if not rec.error and not ok:
        rec.error = "the stream ended without any text or finish_reason"
    return RequestOutput(
        success=ok,
        prompt_len=prompt_len,
        output_len=int(rec.usage.get("completion_tokens", 0)),
        ttft=rec.first_at - rec.sent_at if ok else 0.0,
        itl=tuple(rec.itl),
        latency=end - rec.sent_at,
        start_time=rec.sent_at - t0,
        generated_text="".join(rec.pieces),
        error=rec.error,
        server_prompt_tokens=int(rec.usage.get("prompt_tokens", 0)),
    )
