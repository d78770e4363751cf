"""D's token stream for one sub-request, as the relay hands it on (docs/internal_api.md, step 3).

    opened (200 headers) ─▶ watch(): the first frame is read while P still works ─▶ frames() ─▶ close()

`watch` lets the relay see a decode worker end the request before P answered (its KV failed: lease, P gone)
or start it without P (it recomputed the prompt). Closing the stream before its last frame hangs up, which
tells D to abort the request and free its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from pdserve.router.frames import Frame, FrameDecoder
from pdserve.router.plan import SubRequest
from pdserve.router.registry import Worker

_DRAIN_TIMEOUT_S = 0.5
FAILED_FINISH = ("abort", "error")


class WorkerFailed(Exception):
    """A worker could not do its part (refused, 5xx, broken stream); the message names it.

    `role` says whose part failed: a failed prefill worker is not tried again for the request, a failed decode
    worker is (the registry learns it is gone). `reason` labels `pdserve_retries`."""

    def __init__(self, message: str, role: str = "prefill", reason: str = "prefill_failed") -> None:
        super().__init__(message)
        self.role = role
        self.reason = reason


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    num_cached_tokens: int
    num_computed_tokens: int
    prefill_s: float


NO_PREFILL = PrefillResult(-1, 0, 0, 0.0)  # D recomputed the prompt: P's answer never came


def failed_frame(frame: Frame) -> bool:
    return frame.finish_reason in FAILED_FINISH or bool(frame.error)


class DecodeStream:
    """D's open token stream for one sub-request."""

    def __init__(self, sub: SubRequest, response: httpx.Response, decode: Worker,
                 prefill: PrefillResult = NO_PREFILL) -> None:
        self.sub = sub
        self.decode = decode
        self.prefill = prefill
        self._response = response
        self._chunks = response.aiter_raw()
        self._decoder = FrameDecoder()
        self._ready: list[Frame] = []  # decoded, not yet handed out
        self._head: asyncio.Task[Frame] | None = None
        self._finished = False
        self._closed = False

    def watch(self) -> asyncio.Task[Frame]:
        """Start reading: the task resolves with the first frame (or raises WorkerFailed)."""
        if self._head is None:
            self._head = asyncio.create_task(self._first_frame())
        return self._head

    async def _first_frame(self) -> Frame:
        while not self._ready:
            chunk = await self._next_chunk()
            if chunk is None:
                raise WorkerFailed(f"decode worker {self.decode.worker_id} ended the stream of "
                                   f"{self.sub.request_id} before its first frame", "decode", "decode_failed")
            self._ready = self._decode(chunk)
        return self._ready[0]

    async def frames(self) -> AsyncIterator[Frame]:
        """Frames up to the one with a finish_reason; raises WorkerFailed if the stream breaks first."""
        if self._head is not None:
            await self._head
        while True:
            ready, self._ready = self._ready, []
            for frame in ready:
                self._finished = frame.finish_reason is not None
                yield frame
                if self._finished:
                    return
            chunk = await self._next_chunk()
            if chunk is None:
                break
            self._ready = self._decode(chunk)
        raise WorkerFailed(f"decode worker {self.decode.worker_id} ended the stream of {self.sub.request_id} "
                           f"without a finish frame ({self._decoder.pending_bytes} bytes of a partial frame)",
                           "decode", "decode_failed")

    async def _next_chunk(self) -> bytes | None:
        try:
            return await anext(self._chunks, None)
        except httpx.TransportError as exc:
            self.decode.reachable = False  # no new work there until its next heartbeat or status answer
            raise WorkerFailed(f"decode worker {self.decode.worker_id} broke the stream of "
                               f"{self.sub.request_id}: {exc!r}", "decode", "decode_failed") from exc

    def _decode(self, chunk: bytes) -> list[Frame]:
        try:
            return self._decoder.feed(chunk)
        except ValueError as exc:  # msgpack's errors are ValueErrors too
            raise WorkerFailed(f"decode worker {self.decode.worker_id} sent a corrupt frame for "
                               f"{self.sub.request_id}: {exc}", "decode", "decode_failed") from exc

    async def discard(self) -> None:
        """Hang up without counting (a start that failed): D aborts the request."""
        if self._head is not None and not self._head.done():
            self._head.cancel()
        if self._head is not None:
            await asyncio.gather(self._head, return_exceptions=True)
        await self._response.aclose()

    async def close(self) -> None:
        """After the finish frame: read the (empty) rest so the connection is reused. Before it: hang up,
        which tells D to abort the request and free its blocks."""
        if self._closed:
            return
        self._closed = True
        self.decode.inflight -= 1
        if self._finished:
            with contextlib.suppress(TimeoutError, httpx.HTTPError):  # D kept the stream open: just hang up
                async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                    async for _ in self._chunks:
                        pass
        await self.discard()
