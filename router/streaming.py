"""Relaying started sub-requests to the client: as SSE events, or collected into one JSON body.

Whatever ends the relay (last frame, worker failure, client gone) the `finally` closes every DecodeStream,
shielded from cancellation: closing a stream early is how a decode worker learns to free the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.decode_stream import DecodeStream, WorkerFailed
from pdserve.router.errors import APIError
from pdserve.router.frames import Frame
from pdserve.router.metrics import RouterMetrics, StreamTimer
from pdserve.router.relay import finish_despite_cancel, upstream_error
from pdserve.router.responses import DONE_EVENT, ResponseWriter

CLIENT_CLOSED = 499  # nginx's status for "client closed the request", used in the request counter
_FAILED_FINISH = ("abort", "error")


class SSEStream:
    """The events of one streaming response. Closed exactly once, by whichever comes first: the end of the
    events, or RelayResponse's finally (the client left, possibly before the first event was asked for)."""

    def __init__(self, streams: list[DecodeStream], writer: ResponseWriter, metrics: RouterMetrics,
                 arrival: float) -> None:
        self._streams = streams
        self._writer = writer
        self._metrics = metrics
        self._arrival = arrival
        self._status = CLIENT_CLOSED
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        writer = self._writer
        try:
            if writer.plan.chat:
                yield writer.role_event()
            async for position, frame in _frames(self._streams, writer, self._metrics, self._arrival):
                event = writer.chunk_event(position, frame)
                if event is not None:
                    yield event
            if writer.plan.include_usage:
                yield writer.usage_event()
            self._status = 200
            yield DONE_EVENT
        except APIError as exc:
            self._status = exc.status
            yield exc.sse_event()
            yield DONE_EVENT
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await close_all(self._streams)
        self._metrics.count_request(self._status)


class RelayResponse(StreamingResponse):
    """Server-sent events of an SSEStream, which is closed however the response ends."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._stream.close()


async def collect(streams: list[DecodeStream], writer: ResponseWriter, metrics: RouterMetrics,
                  arrival: float, request: Request) -> dict:
    """The whole response; stops early (closing the streams) if the client disconnects while waiting."""
    relay = asyncio.create_task(_collect(streams, writer, metrics, arrival))
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, watch):
            task.cancel()
        await asyncio.gather(relay, watch, return_exceptions=True)
        await finish_despite_cancel(close_all(streams))
    if relay.cancelled():
        raise APIError(CLIENT_CLOSED, "client closed the request")
    if relay.exception() is not None:
        raise relay.exception()  # type: ignore[misc]
    metrics.count_request(200)
    return relay.result()


async def _collect(streams: list[DecodeStream], writer: ResponseWriter, metrics: RouterMetrics,
                   arrival: float) -> dict:
    async for _ in _frames(streams, writer, metrics, arrival):
        pass
    return writer.final_body()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _frames(streams: list[DecodeStream], writer: ResponseWriter, metrics: RouterMetrics,
                  arrival: float) -> AsyncIterator[tuple[int, Frame]]:
    """Every stream's frames, recorded in the writer and timed; a failed stream raises APIError."""
    timers = [StreamTimer(metrics, arrival) for _ in streams]
    source = _single(streams[0]) if len(streams) == 1 else _merged(streams)
    try:
        async for position, frame in source:
            timers[position].on_frame(time.perf_counter())
            if frame.finish_reason in _FAILED_FINISH or frame.error:
                stream = streams[position]
                raise upstream_error(f"decode worker {stream.decode.worker_id} ended {stream.sub.request_id} "
                                     f"with {frame.finish_reason}: {frame.error}")
            writer.record(position, frame)
            if frame.finish_reason is not None:
                choice = writer.choices[position]
                # a disaggregated D cannot know how much of the prompt P found cached (it reports 0): P's count
                choice.cached_tokens = max(choice.cached_tokens, streams[position].prefill.num_cached_tokens)
                timers[position].on_finish(choice.completion_tokens, len(streams[position].sub.prompt_token_ids),
                                           choice.cached_tokens)
            yield position, frame
    except WorkerFailed as exc:
        raise upstream_error(str(exc)) from exc
    unfinished = [c.index for c in writer.choices if c.finish_reason is None]
    if unfinished:  # DecodeStream.frames raises first; this guards the merge against any other ending
        raise upstream_error(f"choices {unfinished} ended without a finish frame")


async def _single(stream: DecodeStream) -> AsyncIterator[tuple[int, Frame]]:
    async for frame in stream.frames():
        yield 0, frame


async def _merged(streams: list[DecodeStream]) -> AsyncIterator[tuple[int, Frame]]:
    """Frames of several streams in arrival order (n > 1 or several prompts)."""
    queue: asyncio.Queue[tuple[int, Frame | None, BaseException | None]] = asyncio.Queue()

    async def pump(position: int, stream: DecodeStream) -> None:
        error: WorkerFailed | None = None
        try:
            async for frame in stream.frames():
                queue.put_nowait((position, frame, None))
        except WorkerFailed as exc:  # handed to the consumer, which raises it
            error = exc
        finally:  # always tell the consumer this stream is over, or it would wait forever
            queue.put_nowait((position, None, error))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            position, frame, error = await queue.get()
            if error is not None:
                raise error
            if frame is None:
                remaining -= 1
                continue
            yield position, frame
    finally:
        for task in pumps:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pumps, return_exceptions=True)


async def close_all(streams: list[DecodeStream]) -> None:
    await asyncio.gather(*(stream.close() for stream in streams))
